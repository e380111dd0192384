"""Engine invariants: batching does not change answers; each image is encoded once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.scoring import AnswerTokens
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.config_io import ModelError
from vlmbatch.preprocessing.prepare import prepare


@pytest.fixture(scope="module")
def model(random_model_dir):  # noqa: ANN001, ANN201
    return load_model(random_model_dir)


def images(model, n: int = 4) -> list:  # noqa: ANN001
    rng = np.random.default_rng(3)
    sizes = [(56, 56), (150, 60), (40, 130), (200, 200)][:n]
    return [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), model.spec.tiling)
            for w, h in sizes]


def test_batched_equals_one_at_a_time(model) -> None:  # noqa: ANN001
    ims = images(model)
    qs = ["is there a red shape?", "no", "does the image contain a circle? yes or no, please"]
    reqs = [Request(i, q) for i in range(len(ims)) for q in qs]
    together = TorchEngine(model, EngineConfig(max_batch_tokens=100_000)).score(ims, reqs)
    single = TorchEngine(model, EngineConfig(prefix_cache=False))  # cold, one at a time
    for r, s in zip(reqs, together):
        alone = single.score([ims[r.image]], [Request(0, r.question)])[0]
        assert abs(alone.margin - s.margin) <= 1e-4
        assert alone.image_tokens == s.image_tokens


def test_each_image_encoded_once(model) -> None:  # noqa: ANN001
    ims = images(model)
    engine = TorchEngine(model, EngineConfig(max_batch_tiles=3))
    engine.score(ims, [Request(i, f"question {k}") for i in range(len(ims)) for k in range(5)])
    assert engine.stats.vision_tiles == sum(im.grid.num_tiles for im in ims)


def test_answer_tokens_must_be_single_tokens(model) -> None:  # noqa: ANN001
    tok = model.tokenizer
    words = ("yes", "Yes", "definitely-not-a-token")
    t = AnswerTokens.from_words(tok, words, ("no",))
    single = [tok.encode(w, add_special_tokens=False) for w in words]
    assert list(t.yes_ids) == [ids[0] for ids in single if len(ids) == 1]
    assert t.yes_ids and len(t.no_ids) == 1
    with pytest.raises(ValueError, match="single token"):
        AnswerTokens.from_words(tok, ("zzzqqq",), ("no",))


def test_missing_and_unknown_models(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="config.json"):
        load_model(tmp_path / "nope")
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text('{"model_type": "llava"}')
    with pytest.raises(ModelError, match="'llava' .* not supported"):
        load_model(tmp_path / "llava")


@pytest.mark.parametrize("mode", ["reference", "reduced"])
@pytest.mark.parametrize("budget", [4, 8, 12, 20, 52])
def test_max_image_tokens_is_honoured(model, mode: str, budget: int) -> None:  # noqa: ANN001
    from vlmbatch.engine.config import ModelConfig
    from vlmbatch.engine.loading import image_plan_for

    tiling = image_plan_for(model.family, model.spec,
                            ModelConfig(tiling=mode, max_image_tokens=budget))
    tpt = model.spec.tokens_per_tile
    rng = np.random.default_rng(budget)
    for w, h in rng.integers(10, 3000, size=(100, 2)):
        assert tiling.plan(int(w), int(h)).num_tiles * tpt <= budget


def test_budget_below_one_tile_is_a_config_error(model) -> None:  # noqa: ANN001
    from vlmbatch.engine.config import ConfigError, ModelConfig
    from vlmbatch.engine.loading import image_plan_for

    with pytest.raises(ConfigError, match="less than one tile"):
        image_plan_for(model.family, model.spec,
                       ModelConfig(max_image_tokens=model.spec.tokens_per_tile - 1))


@pytest.mark.parametrize("cache", [False, True])
def test_expanded_kv_equals_enable_gqa(model, monkeypatch, cache: bool) -> None:  # noqa: ANN001
    """The CUDA attention form (K/V repeated per query head) answers as the CPU one, with
    cached prefixes and greedy generation too (the random model has 4 q / 2 kv heads)."""
    import vlmbatch.models.decoder

    assert model.spec.text.heads != model.spec.text.kv_heads
    ims = images(model, 3)
    reqs = [Request(i, q) for i in range(3) for q in ("is there a red shape?", "no")]
    cfg = EngineConfig(prefix_cache=cache, max_new_tokens=4, ignore_eos=True)
    out = {}
    for expand in (False, True):
        monkeypatch.setattr(vlmbatch.models.decoder, "EXPAND_KV", expand)
        out[expand] = TorchEngine(model, cfg).score(ims, reqs)
    assert max(abs(a.margin - b.margin) for a, b in zip(out[False], out[True])) <= 1e-5
    assert [a.text for a in out[False]] == [b.text for b in out[True]]


@pytest.mark.parametrize("cache", [False, True])
def test_per_question_generation_equals_the_global_setting(model, cache: bool) -> None:  # noqa: ANN001
    """A question's own max_new_tokens (the few that need an explanation) generates what
    the engine-wide --max-new-tokens would for it, token for token; the other rows of the
    same batches only get P(yes), which is unchanged."""
    ims = images(model, 3)
    qs = ["is there a red shape?", "no", "does the image contain a circle?"]
    plain = [Request(i, q) for i in range(3) for q in qs]
    limit = {0: 6, 2: 3}  # by question index; question 1 gets no text
    mixed = [Request(i, q, limit.get(k)) for i in range(3) for k, q in enumerate(qs)]
    none = TorchEngine(model, EngineConfig(prefix_cache=cache)).score(ims, plain)
    got = TorchEngine(model, EngineConfig(prefix_cache=cache)).score(ims, mixed)
    ref = {n: TorchEngine(model, EngineConfig(prefix_cache=cache, max_new_tokens=n)).score(
        ims, plain) for n in (3, 6)}
    assert max(abs(a.margin - b.margin) for a, b in zip(got, none)) <= 1e-5
    for j, r in enumerate(mixed):
        want = None if r.max_new_tokens is None else ref[r.max_new_tokens][j].text
        assert got[j].text == want, (j, got[j].text, want)
    assert sum(s.text is not None for s in got) == 6
    # a request may also turn generation off where the engine has it on
    off = TorchEngine(model, EngineConfig(prefix_cache=cache, max_new_tokens=6))
    assert [s.text for s in off.score(ims, [Request(0, "no", 0)])] == [None]


def test_a_lone_decoding_row_that_is_not_the_longest(model) -> None:  # noqa: ANN001
    """One row of a batch decodes while the others only score: its past is shorter than the
    batch's padded past (some images cached, some not) and its new tokens fewer than the
    batch's width, so the masks must use the batch's widths with the row's own lengths."""
    ims = images(model, 4)
    qs = ["is there a red shape?", "no"]
    plain = [Request(i, q) for i in range(4) for q in qs]
    want = TorchEngine(model, EngineConfig(prefix_cache=False, max_new_tokens=5)).score(
        ims, plain)
    for lone in range(len(plain)):
        engine = TorchEngine(model, EngineConfig())
        engine.score([ims[0], ims[3]], [Request(0, "warm?"), Request(1, "warm?")])
        reqs = [Request(r.image, r.question, 5 if j == lone else None)
                for j, r in enumerate(plain)]
        got = engine.score(ims, reqs)
        assert [s.text for s in got] == [want[lone].text if j == lone else None
                                         for j in range(len(plain))]
        assert max(abs(a.margin - b.margin) for a, b in zip(got, want)) <= 1e-4


def test_yes_no_reads_the_right_logits_in_and_out_of_inference_mode() -> None:
    """P(yes) = softmax over the union, restricted to yes; the cached answer-token index is
    built once (first inside inference mode, as the engine does) and still serves logits
    that need gradients (calibration code may want them)."""
    import torch

    from vlmbatch.engine.scoring import yes_no

    tokens = AnswerTokens((1, 3), (0,))
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.5, 9.0]])
    with torch.inference_mode():
        p, m = yes_no(logits, tokens)
    want = torch.logsumexp(torch.tensor([0.5, 1.5]), 0) - 2.0
    assert abs(float(m[0]) - float(want)) < 1e-6
    assert abs(float(p[0]) - float(torch.sigmoid(want))) < 1e-6
    g = logits.clone().requires_grad_(True)
    p, _ = yes_no(g, tokens)
    p.sum().backward()
    assert g.grad is not None and g.grad[0, 4] == 0 and g.grad[0, 2] == 0
