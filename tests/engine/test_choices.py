"""Label sets through our engine against transformers (fp32, CPU, random weights): InternVL
and the Qwen-VL families (Qwen3.5 too: its own CI tests in ``test_hybrid_choices.py``), each a
tiny checkpoint with our tokenizer.

- prompts: a system turn and an instruction render as transformers' ``apply_chat_template``
  renders the same messages, and a choice's tokens are what the template's assistant turn
  holds after the prompt (no leading space: chatml opens the answer after
  ``<|im_start|>assistant\\n``);
- ``logprobs`` = transformers' summed token log-likelihoods of prompt + choice (one forward
  over the whole sequence per choice) to 1e-4; ``probs`` their softmax (1e-6, as rounded);
  first-token scoring = log-softmax of the prompt's last logits at each first token;
- cache on = off; label-set rows batched with yes/no and text rows change none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import reference_pixels as internvl_pixels
from tests.models.qwen_vl_helpers import KINDS, reference_pixels, save_engine_checkpoint
from vlmbatch.engine.config import ChoiceError, EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import ImageOptions, LoadedModel
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Answer, request_of
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid

FAMILIES = ("internvl", *KINDS)
SIZES = [(56, 56), (200, 90), (30, 170)]  # (width, height)
# one-token and several-token choices, a choice that is another's first tokens, non-ASCII
LABELS = ("yes", "no", "a red circle", "red", "hate speech", "Sí, claro", "self-harm")
SHAPES = ("circle", "rectangle", "triangle")
TOL = 1e-4


@dataclass
class Models:
    family: str
    path: Path
    ours: LoadedModel
    ref: torch.nn.Module

    def image_placeholder(self, im: PreparedImage) -> tuple[str, str]:
        """The chat template's image placeholder and its expansion for ``im``."""
        if self.family == "internvl":
            n = im.grid.num_tiles * self.ours.spec.tokens_per_tile  # type: ignore[attr-defined]
            return "<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * n + "</img>"
        assert isinstance(im.grid, PatchGrid)
        return "<|image_pad|>", "<|image_pad|>" * im.grid.tokens

    def rendered_ids(self, messages: list[dict], im: PreparedImage, generation: bool
                     ) -> list[int]:
        """transformers' rendering of ``messages``, the image expanded, tokenized."""
        tok = self.ours.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=generation)
        text = text.replace(*self.image_placeholder(im))
        return tok(text, add_special_tokens=False)["input_ids"]

    def logits(self, ids: list[int], im: PreparedImage) -> torch.Tensor:
        """transformers' logits ``[L, V]`` over the whole sequence ``ids`` about ``im``."""
        x = torch.tensor([ids])
        with torch.no_grad():
            if self.family == "internvl":
                return self.ref(input_ids=x, pixel_values=internvl_pixels(
                    torch.from_numpy(im.rows))).logits[0]
            v = self.ours.spec.vision  # type: ignore[attr-defined]
            assert isinstance(im.grid, PatchGrid)
            return self.ref(input_ids=x, mm_token_type_ids=(x == self.ours.spec.image_token_id)
                            .int(), pixel_values=reference_pixels(torch.from_numpy(im.rows),
                                                                  v.mean, v.std),
                            image_grid_thw=torch.tensor([im.grid.thw])).logits[0]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory,
           random_model_dir: Path) -> Callable[[str], Models]:
    """A family's checkpoint, ours and transformers' models, made once per module when a
    test first asks for it (the slow families' only under --run-slow)."""
    from transformers import AutoModelForImageTextToText, InternVLForConditionalGeneration

    made: dict[str, Models] = {}

    def get(family: str) -> Models:
        if family not in made:
            if family == "internvl":
                made[family] = Models(family, random_model_dir, load_model(random_model_dir),
                                      InternVLForConditionalGeneration.from_pretrained(
                                          str(random_model_dir)).eval())
            else:
                path = save_engine_checkpoint(family, tmp_path_factory.mktemp(family))
                made[family] = Models(family, path, load_model(path),
                                      AutoModelForImageTextToText.from_pretrained(
                                          str(path)).eval())
        return made[family]

    return get


# in CI: InternVL and Qwen2.5-VL; Qwen2-VL and Qwen3-VL with --run-slow (the same code path:
# the M-RoPE text positions after the image, a DeepStack decoder for Qwen3-VL)
@pytest.fixture(params=[pytest.param(f, marks=[] if f in ("internvl", "qwen2_5_vl")
                                     else [pytest.mark.slow]) for f in FAMILIES])
def models(request: pytest.FixtureRequest, loaded: Callable[[str], Models]) -> Models:
    return loaded(request.param)


def images(m: Models, sizes: list[tuple[int, int]], seed: int = 0) -> list[PreparedImage]:
    plan = m.ours.family.image_plan(m.ours.spec, ImageOptions("reduced", None, 1.0, None))
    rng = np.random.default_rng(seed)
    return [plan.prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def test_system_turn_and_instruction_render_as_transformers(models: Models) -> None:
    """A system turn before the image and an instruction before the question: our ids =
    the template's rendering of the same messages, the system turn inside the shared
    prefix (before the image's end marker)."""
    (im,) = images(models, [(200, 90)])
    q = Question("q", "Is there a red shape?", prompt="Answer yes or no.",
                 system="You are a careful content moderator.")
    p = models.ours.prompts.build(q.user_text, im, q.system)
    want = models.rendered_ids([{"role": "system", "content": q.system}, user(q.user_text)],
                               im, True)
    assert list(p.ids) == want
    sys_ids = models.ours.tokenizer.encode(q.system, add_special_tokens=False)
    assert _find(p.ids[: p.prefix_len], sys_ids)  # in the prefix the cache shares
    plain = models.ours.prompts.build(q.text, im)
    assert list(plain.ids) == models.rendered_ids([user(q.text)], im, True)
    assert p.ids[p.image_start:] != plain.ids[plain.image_start:]  # the instruction is in


def test_choices_tokenize_as_the_assistant_turn(models: Models) -> None:
    """Our prompt + a choice's ``answer_ids`` are how the template's whole conversation with
    the choice as the assistant's answer tokenizes (then the turn's end); the choice follows
    the generation prompt without a leading space."""
    (im,) = images(models, [(56, 56)])
    prompts = models.ours.prompts
    assert prompts.layout.answer_lead == ""  # type: ignore[attr-defined]
    for system in (None, "Be brief."):
        p = prompts.build("Which is it?", im, system)
        head = [] if system is None else [{"role": "system", "content": system}]
        for c in LABELS:
            full = models.rendered_ids([*head, user("Which is it?"),
                                        {"role": "assistant", "content": c}], im, False)
            ids = prompts.answer_ids(c)
            assert full[: len(p.ids) + len(ids)] == [*p.ids, *ids], c
            assert len(full) > len(p.ids) + len(ids)  # the end of the turn follows
            assert ids == tuple(models.ours.tokenizer.encode(c, add_special_tokens=False))


def _find(seq: tuple[int, ...], sub: list[int]) -> bool:
    return any(list(seq[i: i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


def reference_logprobs(m: Models, p_ids: tuple[int, ...], im: PreparedImage,
                       choices: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """transformers' (summed, first-token) log-likelihood of each choice after the prompt:
    one forward over prompt + choice per choice."""
    total, first = [], []
    for c in choices:
        ids = m.ours.prompts.answer_ids(c)
        lsm = torch.log_softmax(m.logits([*p_ids, *ids], im).double(), -1)
        n = len(p_ids)
        per = [float(lsm[n - 1 + i, t]) for i, t in enumerate(ids)]
        total.append(sum(per))
        first.append(per[0])
    return total, first


def label_requests(ims: list[PreparedImage]) -> list[Request]:
    """Label sets of 7 and 3 choices, a yes/no question and a text answer about each image,
    one label set behind a system turn and an instruction."""
    q = Question("c", "Which one?", prompt="Pick one label.", system="You label images.",
                 choices=SHAPES)
    out = []
    for i in range(len(ims)):
        out += [Request(i, "Which label fits?", choices=LABELS), request_of(i, q),
                Request(i, "is there a red shape?"), Request(i, "Describe it.", 3)]
    return out


def test_logprobs_match_transformers(models: Models) -> None:
    """Exact scoring = transformers' summed log-likelihoods; probs their softmax; several
    batches (a small --max-batch-tokens), label sets beside yes/no and text rows. Measured
    max |difference|: 7.0e-6 (InternVL), 8.6e-6 / 4.6e-6 / 4.7e-6 (Qwen2-VL / 2.5 / 3);
    continuation positions one too far, or choices that see each other's tokens, fail it."""
    ims = images(models, SIZES)
    reqs = label_requests(ims)
    engine = TorchEngine(models.ours, EngineConfig(max_batch_tokens=400))
    scores = engine.score(ims, reqs)
    worst = 0.0
    for r, s in zip(reqs, scores):
        if not r.choices:
            assert s.logprobs is None
            continue
        p = models.ours.prompts.build(r.question, ims[r.image], r.system)
        want, _ = reference_logprobs(models, p.ids, ims[r.image], r.choices)
        assert s.logprobs is not None and len(s.logprobs) == len(r.choices)
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, want)))
        a = Answer.scored("i", Question("c", r.question, choices=r.choices), s)
        soft = torch.softmax(torch.tensor(want, dtype=torch.float64), 0)
        assert a.probs is not None and a.label == r.choices[int(soft.argmax())]
        assert max(abs(a.probs[c] - float(v)) for c, v in zip(r.choices, soft)) <= 1e-5
    print(f"{models.family}: max |logprobs - transformers'| {worst:.1e}")  # pytest -s
    assert worst <= TOL, worst


def test_first_token_scoring_and_cache(models: Models, request: pytest.FixtureRequest) -> None:
    """--choice-scoring first-token = the log-softmax of the prompt's last logits at each
    choice's first token (transformers'); with either scoring the cache changes nothing,
    and neither do the label-set rows to the yes/no and text rows beside them. In CI on
    InternVL only (the Qwen-VL families with --run-slow)."""
    if models.family != "internvl" and not request.config.getoption("--run-slow"):
        pytest.skip("slow: run with --run-slow")
    ims = images(models, SIZES, seed=1)
    reqs = [r for r in label_requests(ims) if r.choices != LABELS]  # LABELS share "red"
    first = TorchEngine(models.ours, EngineConfig(choice_scoring="first-token")).score(ims, reqs)
    for r, s in zip(reqs, first):
        if r.choices:
            p = models.ours.prompts.build(r.question, ims[r.image], r.system)
            _, want = reference_logprobs(models, p.ids, ims[r.image], r.choices)
            assert s.logprobs is not None
            assert max(abs(a - b) for a, b in zip(s.logprobs, want)) <= TOL
    plain = [r for r in reqs if not r.choices]
    alone = TorchEngine(models.ours, EngineConfig(prefix_cache=False)).score(ims, plain)
    for scoring in ("exact", "first-token"):
        off = TorchEngine(models.ours, EngineConfig(prefix_cache=False,
                                                    choice_scoring=scoring)).score(ims, reqs)
        on = TorchEngine(models.ours, EngineConfig(choice_scoring=scoring, block_size=4))
        on.score(ims, reqs)
        again = on.score(ims, reqs)  # every prefix from the cache now
        assert on.cache is not None and on.cache.stats.hits > 0
        for a, b in zip(off, again):
            assert abs(a.margin - b.margin) <= 1e-5 and a.text == b.text
            if a.logprobs is not None:
                assert b.logprobs is not None
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        mixed = [s for r, s in zip(reqs, off) if not r.choices]
        assert max(abs(a.margin - b.margin) for a, b in zip(mixed, alone)) <= 1e-5
        assert [a.text for a in mixed] == [b.text for b in alone]


def test_first_token_mode_refuses_choices_sharing_a_first_token(models: Models) -> None:
    engine = TorchEngine(models.ours, EngineConfig(choice_scoring="first-token"))
    ims = images(models, [(56, 56)])
    with pytest.raises(ChoiceError, match="'a red circle' and 'red'|'red' and 'a red circle'"
                       if _same_first(models, "a red circle", "red") else "'yes'"):
        engine.score(ims, [Request(0, "Which?", choices=("yes", "no", "red", "a red circle",
                                                         "yes please"))])
    TorchEngine(models.ours, EngineConfig()).check_choices(("red", "a red circle"))  # exact


def _same_first(m: Models, a: str, b: str) -> bool:
    return m.ours.prompts.answer_ids(a)[0] == m.ours.prompts.answer_ids(b)[0]


def test_a_shared_instruction_is_prefilled_once(models: Models) -> None:
    """Two questions about one image behind the same system turn and instruction: the second
    prefills only from the first token where the prompts differ (the instruction after the
    image comes from the cache), and both answer as without a cache. A hybrid decoder
    (Qwen3.5) too: the first question's forward takes a state snapshot where the two
    prompts start to differ (``docs/hybrid_cache.md``)."""
    (im,) = images(models, [(200, 90)])
    qs = [Question(k, t, prompt="Look at the whole image, then answer yes or no.",
                   system="You label images.") for k, t in (("a", "Is it red?"),
                                                             ("b", "Is there a circle?"))]
    reqs = [request_of(0, q) for q in qs]
    p1, p2 = (models.ours.prompts.build(r.question, im, r.system) for r in reqs)
    common = next(i for i, (x, y) in enumerate(zip(p1.ids, p2.ids)) if x != y)
    assert common > p1.prefix_len + 8  # the instruction's tokens are after the image
    on = TorchEngine(models.ours, EngineConfig(block_size=4))
    got = on.score([im], reqs)
    assert on.stats.prefill_tokens == len(p1.ids) + len(p2.ids) - common
    off = TorchEngine(models.ours, EngineConfig(prefix_cache=False)).score([im], reqs)
    assert max(abs(a.margin - b.margin) for a, b in zip(got, off)) <= 1e-5
