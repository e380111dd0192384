"""Yes/no scoring from the first generated position's logits, and the token ids of a label
set's choices.

P(yes) = sum of softmax over the union of the yes and no answer tokens, restricted to yes.
Answer words are given as text ("yes", "Yes", ...); each must be a single token of the model's
vocabulary (multi-token words are skipped, and at least one word per side must survive).
The logit margin ``logsumexp(yes) - logsumexp(no)`` is kept for calibration.

A label set's choice is scored as the assistant's whole answer (``choice_ids``: the prompt
builder's ``answer_ids``): log P(choice | prompt) = sum over its tokens of
log P(token_i | prompt, token_<i), or with ``first-token`` scoring its first token's alone.
The runner computes both (``engine/model_runner.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmbatch.engine.config import AnswerWordsError, ChoiceError

ChoiceIds = tuple[tuple[int, ...], ...]  # per choice, its answer token ids (at least one)


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
    logits = logits if logits.dtype == torch.float32 else logits.float()
    ly = logits.index_select(1, _index(tokens.yes_ids, logits.device)).logsumexp(-1)
    ln = logits.index_select(1, _index(tokens.no_ids, logits.device)).logsumexp(-1)
    margin = ly - ln
    return torch.sigmoid(margin), margin


def choice_ids(answer_ids: Callable[[str], tuple[int, ...]], choices: tuple[str, ...],
               first_token: bool = False) -> ChoiceIds:
    """Each choice's token ids (``answer_ids``); ChoiceError naming the choices that cannot
    be told apart: the same ids, or with ``first_token`` the same first id."""
    ids = tuple(answer_ids(c) for c in choices)
    if empty := [c for c, x in zip(choices, ids) if not x]:
        raise ChoiceError(f"choice {empty[0]!r} has no tokens")
    seen: dict[tuple[int, ...], str] = {}
    for c, x in zip(choices, ids):
        key = x[:1] if first_token else x
        if key in seen:
            why = (f"start with the same token ({key[0]}): --choice-scoring first-token "
                   "cannot tell them apart; use the default, exact" if first_token
                   else "are the same tokens")
            raise ChoiceError(f"choices {seen[key]!r} and {c!r} {why}")
        seen[key] = c
    return ids
