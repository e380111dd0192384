"""Yes/no scoring from the first generated position's logits.

P(yes) = sum of softmax over the union of the yes and no answer tokens, restricted to yes.
Answer words are given as text ("yes", "Yes", ...); each must be a single token of the model's
vocabulary (multi-token words are skipped, and at least one word per side must survive).
The logit margin ``logsumexp(yes) - logsumexp(no)`` is kept for calibration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# re-exported: defined with the configs (a light module: the CLI catches it)
from vlmbatch.pipeline.config import AnswerWordsError as AnswerWordsError


@dataclass(frozen=True)
class AnswerTokens:
    yes_ids: tuple[int, ...]
    no_ids: tuple[int, ...]

    @classmethod
    def from_words(cls, tokenizer, yes: tuple[str, ...], no: tuple[str, ...]) -> AnswerTokens:  # noqa: ANN001
        def ids(words: tuple[str, ...], side: str) -> tuple[int, ...]:
            out = []
            for w in words:
                enc = tokenizer.encode(w, add_special_tokens=False)
                if len(enc) == 1 and enc[0] not in out:
                    out.append(enc[0])
            if not out:
                raise AnswerWordsError(f"none of the {side} answer words {list(words)} is a single "
                                 "token of this model's vocabulary; pass others")
            return tuple(out)

        y, n = ids(yes, "yes"), ids(no, "no")
        if set(y) & set(n):
            raise AnswerWordsError(f"yes and no answer tokens overlap: {set(y) & set(n)}")
        return cls(y, n)


@functools.lru_cache(maxsize=64)
def _index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Token ids as an index tensor on ``device``, built once: indexing with a Python list
    would copy it to the GPU in every call, and that copy waits for the GPU to finish."""
    with torch.inference_mode(False):  # kept: a normal tensor, usable outside inference mode
        return torch.tensor(ids, dtype=torch.long).to(device)


def yes_no(logits: torch.Tensor, tokens: AnswerTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (p_yes [B], margin [B]), float32, on the logits' device."""
    logits = logits.float()
    ly = logits.index_select(1, _index(tokens.yes_ids, logits.device)).logsumexp(-1)
    ln = logits.index_select(1, _index(tokens.no_ids, logits.device)).logsumexp(-1)
    margin = ly - ln
    return torch.sigmoid(margin), margin
