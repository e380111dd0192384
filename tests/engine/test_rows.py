"""The one-forward path (``engine/packing.py``: an image's prefix and its questions in one
row, block-causal; ``question_rows="on"``, the default on CUDA) against the two paths it
replaces, on every family: the phases
(leaders, then followers after the cached prefix) and the cacheless engine (every prompt
prefilled whole), margins within 1e-5 (fp32, CPU, tiny random checkpoints). A question that
sees another question's tokens (the fault the mask exists for) is caught.

Families: InternVL HF-native (Qwen2 text), InternVL3.5 (Qwen3 text: QK-norm), InternVL's
original layout (InternLM2: grouped wqkv, dynamic NTK rotary within its trained length),
Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE, DeepStack); and the two kept on the phases, checked
to be (``NO_ROWS``)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import TEXT_MODELS, make_model_dir
from tests.models.internvl_original_helpers import make_pair
from tests.models.qwen_vl_helpers import save_engine_checkpoint
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import ImageOptions, LoadedModel
from vlmbatch.models.decoder import TextDecoder

TOL = 1e-5
ROWS = EngineConfig(question_rows="on")
SIZES = [(56, 56), (200, 90), (30, 170), (120, 60)]  # (width, height)
QUESTIONS = ["is there a red shape?", "Does the image contain a circle?",
             "is the circle left of the square, and is it blue?", "any shapes?"]
FAMILIES = ["internvl_qwen2", "internvl3_5_qwen3", "internvl2_internlm2", "qwen2_vl",
            "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internlm2_past_trained_length"]
# on the phases, not in rows: a hybrid decoder (docs/hybrid_cache.md), and prompts past a
# dynamic rotary's trained length (their base is their own length; a cached prefix keeps
# the base it was computed at, so there even the phases differ from the cacheless engine)
NO_ROWS = ("qwen3_5", "internlm2_past_trained_length")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rows")
    out = {"internvl_qwen2": make_model_dir(root / "qwen2"),
           "internvl3_5_qwen3": make_model_dir(root / "qwen3", text=TEXT_MODELS["qwen3"]),
           "internvl2_internlm2": make_pair(root / "lm2", "internvl2_internlm2",
                                            text={"max_position_embeddings": 4096})[1],
           "internlm2_past_trained_length": make_pair(root / "lm2s", "internvl2_internlm2")[1]}
    for kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        out[kind] = save_engine_checkpoint(kind, root / kind)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, checkpoints: dict[str, Path]
           ) -> tuple[str, LoadedModel]:
    return request.param, load_model(checkpoints[request.param], fuse=True)  # as `run` does


def images(model: LoadedModel, seed: int = 0) -> list:
    plan = model.family.image_plan(model.spec, ImageOptions("reduced", None, 1.0, None))
    rng = np.random.default_rng(seed)
    return [plan.prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


def requests() -> list[Request]:
    """Images with 4, 3, 1 and 2 questions; image 3's second one under a system turn (a
    group of its own: one question after that prefix)."""
    out = [Request(0, q) for q in QUESTIONS]
    out += [Request(1, q) for q in QUESTIONS[1:]] + [Request(2, QUESTIONS[2])]
    return out + [Request(3, QUESTIONS[0]), Request(3, QUESTIONS[3], system="Be brief.")]


def margins(engine: TorchEngine, ims: list, reqs: list[Request]) -> torch.Tensor:
    return torch.tensor([s.margin for s in engine.score(ims, reqs)], dtype=torch.float64)


def phases_only(engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> TorchEngine:
    """The engine with no question in rows: the leaders/followers phases of before."""
    monkeypatch.setattr(engine, "_rows", lambda images, requests, *a: ([], list(
        range(len(requests)))))
    return engine


def test_rows_equal_the_phases_and_the_cacheless_engine(
        family: tuple[str, LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    name, model = family
    ims, reqs = images(model), requests()
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), ims, reqs)
    before = margins(phases_only(TorchEngine(model, ROWS), monkeypatch), ims, reqs)
    monkeypatch.undo()
    engine = TorchEngine(model, ROWS)
    calls: list[int] = []
    real = engine.runner.prefill_rows
    monkeypatch.setattr(engine.runner, "prefill_rows",
                        lambda step, *a: calls.append(len(step)) or real(step, *a))
    rows = margins(engine, ims, reqs)
    again = margins(engine, ims, reqs)  # every prefix cached by the first call: rows after it
    assert (rows - before).abs().max() <= TOL
    if name != "internlm2_past_trained_length":  # there a cached prefix keeps its base
        assert (again - before).abs().max() <= TOL
    if name in NO_ROWS:
        assert calls == []
        return
    assert (rows - off).abs().max() <= TOL and (again - off).abs().max() <= TOL
    assert calls == [5, 5]  # one forward per call: the 5 groups in one step
    assert engine.cache is not None and engine.cache.stats.hits > 0


def test_questions_that_a_row_cannot_hold_follow_it(family: tuple[str, LoadedModel]) -> None:
    """A budget below one image's prefix and all its questions: the row takes what fits,
    the rest follow after its cached prefix (the phases); the same answers."""
    name, model = family
    if name in NO_ROWS:
        pytest.skip("its questions are not put in rows")
    ims, reqs = images(model)[:1], [Request(0, q) for q in QUESTIONS]
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), ims, reqs)
    width = len(model.prompts.build(QUESTIONS[0], ims[0]).ids)
    engine = TorchEngine(model, EngineConfig(max_batch_tokens=width + 12,
                                             question_rows="on"))
    assert (margins(engine, ims, reqs) - off).abs().max() <= TOL


def test_a_question_seeing_another_is_caught(family: tuple[str, LoadedModel],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault: every question of a row in one segment, so each sees the questions
    before it (causally), as a plain concatenation would. Measured |margin| errors of
    0.01 to 1 against the cacheless engine."""
    name, model = family
    if name in NO_ROWS:
        pytest.skip("its questions are not put in rows")
    ims, reqs = images(model), requests()
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), ims, reqs)
    real = TextDecoder.prefill_segments

    def leaky(self, embeds, positions, segments, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        return real(self, embeds, positions, segments.clamp(max=1), *a, **kw)

    monkeypatch.setattr(TextDecoder, "prefill_segments", leaky)
    got = margins(TorchEngine(model, ROWS), ims, reqs)
    assert (got - off).abs().max() > 100 * TOL


def test_a_row_after_a_prefix_cached_inside_the_image(family: tuple[str, LoadedModel],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a tight cache a chain keeps its head, so a later call's row starts inside the
    image: its embeddings (Qwen3-VL: and DeepStack features) are written from there and its
    positions continue from the cached length; the same answers as the cacheless engine."""
    name, model = family
    if name in NO_ROWS:
        pytest.skip("its questions are not put in rows")
    ims, reqs = images(model), requests()
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), ims, reqs)
    probe = TorchEngine(model, ROWS)
    per_token = probe.cache.slot_bytes // 16 if probe.cache is not None else 0
    p = model.prompts.build(QUESTIONS[1], ims[1])
    assert p.image_len >= 2
    keep = p.image_start + 1  # a cache of one-token blocks that holds through 1 image token
    tight = TorchEngine(model, EngineConfig(block_size=1, cache_bytes=keep * per_token,
                                            question_rows="on"))
    first = [r for r in reqs if r.image == 1]  # one image: its chain's head stays
    margins(tight, ims, first)
    starts: list[tuple[int, int, int]] = []
    real = tight.runner.prefill_rows
    monkeypatch.setattr(tight.runner, "prefill_rows", lambda step, *a: starts.extend(
        (r.plan.span.start, r.plan.past_len, r.plan.span.length) for r in step)
        or real(step, *a))
    got = margins(tight, ims, reqs)
    assert (got - off).abs().max() <= TOL
    assert any(s < past < s + n for s, past, n in starts), starts


def test_the_next_step_prepared_on_a_thread_changes_nothing(
        checkpoints: dict[str, Path]) -> None:
    """``prepare_ahead``: step k + 1's host inputs made on a thread during step k (several
    steps: a budget of about a row each)."""
    model = load_model(checkpoints["qwen3_vl"], fuse=True)  # M-RoPE positions made there too
    ims, reqs = images(model), requests()
    width = max(len(model.prompts.build(q, im).ids) for q in QUESTIONS for im in ims)
    cfg = EngineConfig(max_batch_tokens=2 * width, question_rows="on")
    plain = TorchEngine(model, cfg)
    ahead = TorchEngine(model, cfg)
    ahead.prepare_ahead = True
    made: list[str] = []
    real = ahead.runner.step_inputs
    ahead.runner.step_inputs = lambda *a: made.append(  # type: ignore[method-assign]
        threading.current_thread().name) or real(*a)
    assert torch.equal(margins(ahead, ims, reqs), margins(plain, ims, reqs))
    assert len(made) > 2 and all(n.startswith("vlmbatch-step") for n in made)
