"""Label sets on a hybrid decoder (Qwen3.5: Gated DeltaNet and gated full attention) against
transformers' ``Qwen3_5ForConditionalGeneration`` (fp32, CPU, the tiny random Qwen3.5 of
``tests/models/qwen_vl_helpers.py``: every parameter perturbed, slow decays).

After the prompt each choice continues from the linear layers' state at the prompt's end,
replicated per choice (``engine/choices.py``, ``linear_attention.Branches``); the full
layers read the prompt's K/V through the block-causal mask. The reference scores each
choice as one sequence, prompt + choice, in its own forward.

- ``logprobs`` = transformers' summed token log-likelihoods, max |difference| <= 1e-4:
  multi-token choices of unequal lengths (1 to 9 tokens), a system turn and an
  instruction, two images of different sizes in one continuation, label sets batched with
  yes/no and text rows; with the prefix cache (each image's first question takes the
  snapshot in its own forward, the others resume from it) and without (1e-5 apart);
- ``probs`` their softmax; ``--choice-scoring first-token`` the first token's;
- ``{"Yes", "No"}``'s ``probs["Yes"]`` = P(yes) asked with ``--yes Yes --no No`` (the
  test tokenizer spells "yes" in two tokens, "Yes" in one; an answer word is one token);
- faults in the branches (the state not replicated; a choice continuing another prompt's
  state; a row's choices chained as one sequence) move some log-likelihood by > 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_choices import Models, images, reference_logprobs
from tests.models.qwen_vl_helpers import save_engine_checkpoint
from vlmbatch.engine import choices as choices_module
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request, Score
from vlmbatch.models.linear_attention import Branches, GatedDeltaNet
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Answer, request_of

TOL = 1e-4
LABELS = ("a red circle", "hate speech", "no", "blue")  # 7, 9, 1 and 4 tokens here
SHAPES = ("circle", "rectangle", "triangle")
SIZES = [(200, 90), (56, 56)]  # (width, height): prompts of different lengths


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Models:
    from transformers import AutoModelForImageTextToText

    path = save_engine_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    return Models("qwen3_5", Path(path), load_model(path),
                  AutoModelForImageTextToText.from_pretrained(str(path)).eval())


def label_requests() -> list[Request]:
    """Per image: a label set behind a system turn and an instruction, another without,
    a yes/no question and a text answer."""
    q = Question("c", "Which label?", prompt="Pick one label.", system="You label images.",
                 choices=LABELS)
    out = []
    for i in range(len(SIZES)):
        out += [request_of(i, q), Request(i, "Which shape is it?", choices=SHAPES),
                Request(i, "is there a red shape?"), Request(i, "Describe it.", 3)]
    return out


@pytest.fixture(scope="module")
def reference(m: Models) -> list[tuple[list[float], list[float]] | None]:
    """transformers' (summed, first-token) log-likelihoods per request (None: no label
    set)."""
    ims = images(m, SIZES)
    out: list[tuple[list[float], list[float]] | None] = []
    for r in label_requests():
        p = m.ours.prompts.build(r.question, ims[r.image], r.system)
        out.append(reference_logprobs(m, p.ids, ims[r.image], r.choices) if r.choices
                   else None)
    return out


def score(m: Models, **cfg: object) -> list[Score]:
    from vlmbatch.engine.torch_engine import TorchEngine

    return TorchEngine(m.ours, EngineConfig(**cfg)).score(images(m, SIZES),  # type: ignore[arg-type]
                                                          label_requests())


def worst(scores: list[Score], want: list[tuple[list[float], list[float]] | None],
          which: int = 0) -> float:
    """max |logprobs - transformers'| over the label-set rows (``which``: 0 summed, 1 first
    token)."""
    out = 0.0
    for s, w in zip(scores, want):
        if w is None:
            assert s.logprobs is None
            continue
        assert s.logprobs is not None and len(s.logprobs) == len(w[which])
        out = max(out, max(abs(a - b) for a, b in zip(s.logprobs, w[which])))
    return out


def test_logprobs_match_transformers(m: Models, reference: list) -> None:
    """Exact scoring with the cache (snapshots taken and reused) and without, in batches
    small enough to cut the call (--max-batch-tokens 300); probs their softmax; the choices
    really are of unequal lengths."""
    lens = {len(m.ours.prompts.answer_ids(c)) for c in LABELS}
    assert min(lens) == 1 and len(lens) >= 3
    on = score(m, max_batch_tokens=300, block_size=8)
    off = score(m, prefix_cache=False)
    print(f"qwen3_5: max |logprobs - transformers'| {worst(on, reference):.1e}")  # pytest -s
    assert worst(on, reference) <= TOL and worst(off, reference) <= TOL
    for r, a, b, w in zip(label_requests(), on, off, reference):
        assert abs(a.margin - b.margin) <= 1e-5
        if w is None:
            continue
        assert a.logprobs is not None and b.logprobs is not None
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        ans = Answer.scored("i", Question("c", r.question, choices=r.choices), a)
        soft = torch.softmax(torch.tensor(w[0], dtype=torch.float64), 0)
        assert ans.probs is not None and ans.label == r.choices[int(soft.argmax())]
        assert max(abs(ans.probs[c] - float(v)) for c, v in zip(r.choices, soft)) <= 1e-5


def test_first_token_scoring(m: Models, reference: list) -> None:
    assert worst(score(m, choice_scoring="first-token"), reference, which=1) <= TOL


def test_a_yes_no_label_set_is_p_yes(m: Models) -> None:
    """``{"Yes", "No"}`` as a label set gives ``probs["Yes"]`` = the P(yes) of the same
    question asked with ``--yes Yes --no No`` (module docstring)."""
    from vlmbatch.engine.torch_engine import TorchEngine

    ims = images(m, SIZES)
    engine = TorchEngine(m.ours, EngineConfig(yes_words=("Yes",), no_words=("No",)))
    q = Question("q", "Is there a red shape?", choices=("Yes", "No"))
    got = engine.score(ims, [r for i in range(len(ims)) for r in (
        request_of(i, q), Request(i, "Is there a red shape?"))])
    for labelled, plain in zip(got[::2], got[1::2]):
        probs = Answer.scored("i", q, labelled).probs
        assert probs is not None and abs(probs["Yes"] - plain.p_yes) <= 1e-6


def _zero_start(original):  # noqa: ANN001, ANN202
    def branched(self, x, g, beta, state, br):  # noqa: ANN001, ANN202
        return original(self, x, g, beta, None, br)  # every choice from no history
    return branched


def _rolled(original):  # noqa: ANN001, ANN202
    def make(*args):  # noqa: ANN002, ANN202
        b = original(*args)
        return Branches(b.rows.roll(1), b.index, b.valid)  # another prompt's state
    return make


def _chained(original):  # noqa: ANN001, ANN202
    def make(chs, n, to_device):  # noqa: ANN001, ANN202
        b = original(chs, n, to_device)  # one branch per row: its choices in one sequence
        rows = sorted(set(b.rows.tolist()))
        runs = [[r * n + t for t in range(sum(len(x) - 1 for x in chs[r]))] for r in rows]
        width = max(len(x) for x in runs)
        index = [x + [len(chs) * n] * (width - len(x)) for x in runs]
        valid = [[True] * len(x) + [False] * (width - len(x)) for x in runs]
        return Branches(to_device(rows), to_device(index), torch.tensor(valid))
    return make


@pytest.mark.parametrize("fault", ["not replicated", "another prompt's state",
                                   "choices chained"])
def test_faults_in_the_branches_are_caught(m: Models, reference: list, fault: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if fault == "not replicated":
        monkeypatch.setattr(GatedDeltaNet, "_branched", _zero_start(GatedDeltaNet._branched))
    elif fault == "another prompt's state":
        monkeypatch.setattr(choices_module, "_branches", _rolled(choices_module._branches))
    else:
        monkeypatch.setattr(choices_module, "_branches", _chained(choices_module._branches))
    assert worst(score(m, prefix_cache=False), reference) > 1e-3
