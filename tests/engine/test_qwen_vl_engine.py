"""The Qwen-VL family through our engine against transformers (fp32, CPU, tiny random
checkpoints with our tokenizer, ``tests/models/qwen_vl_helpers.py``).

Each test runs ``TorchEngine.score`` (prompts, positions, packed vision, DeepStack, batching,
prefix cache) and compares with ``...ForConditionalGeneration`` on the same uint8 patches
and prompt ids. Tolerances: logits abs 1e-4 over the whole vocabulary row, P(yes) 1e-5,
cache on == cache off 1e-5 (margins), greedy text token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.qwen_vl_helpers import KINDS, reference_pixels, save_engine_checkpoint
from vlmbatch.engine import model_runner
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.planner import Plan
from vlmbatch.engine.records import Request, Score
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import ImageOptions, LoadedModel
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid

SIZES = [(56, 56), (200, 90), (30, 170), (300, 200), (120, 400)]  # (width, height)
QUESTIONS = ["is there a red shape?", "Does the image contain a circle?"]


@dataclass
class Models:
    path: Path
    ours: LoadedModel
    ref: torch.nn.Module


@pytest.fixture(scope="module")
def all_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Models]:
    from transformers import AutoModelForImageTextToText

    out = {}
    for kind in KINDS:
        path = save_engine_checkpoint(kind, tmp_path_factory.mktemp(kind))
        ref = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
        out[kind] = Models(path, load_model(path), ref)
    return out


@pytest.fixture(params=KINDS)
def models(request: pytest.FixtureRequest, all_models: dict[str, Models]) -> Models:
    return all_models[request.param]


def images(m: Models, sizes: list[tuple[int, int]], seed: int = 0) -> list[PreparedImage]:
    plan = m.ours.family.image_plan(m.ours.spec, ImageOptions("reduced", None, 1.0, None))
    rng = np.random.default_rng(seed)
    return [plan.prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def grid(im: PreparedImage) -> PatchGrid:
    assert isinstance(im.grid, PatchGrid)
    return im.grid


def reference_inputs(m: Models, ids: tuple[int, ...], im: PreparedImage) -> dict:
    v = m.ours.spec.vision  # type: ignore[attr-defined]
    x = torch.tensor([ids])
    return dict(input_ids=x, mm_token_type_ids=(x == m.ours.spec.image_token_id).int(),
                pixel_values=reference_pixels(torch.from_numpy(im.rows), v.mean, v.std),
                image_grid_thw=torch.tensor([grid(im).thw]))


def score_with_logits(engine: TorchEngine, ims: list[PreparedImage], reqs: list[Request],
                      monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[list[Score], dict[int, torch.Tensor], list[list[Plan]]]:
    """``engine.score``, plus each request's full logits row and the batches that ran."""
    logits: dict[int, torch.Tensor] = {}
    batches: list[list[Plan]] = []
    prefill, yes_no = engine.runner.prefill, model_runner.yes_no

    def spy_prefill(batch: list[Plan], *args: object) -> object:
        batches.append(list(batch))
        return prefill(batch, *args)  # type: ignore[arg-type]

    def spy_yes_no(x: torch.Tensor, answers: object) -> object:
        logits.update(zip([p.req for p in batches[-1]], x.clone()))
        return yes_no(x, answers)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.runner, "prefill", spy_prefill)
    monkeypatch.setattr(model_runner, "yes_no", spy_yes_no)
    return engine.score(ims, reqs), logits, batches


def margins(engine: TorchEngine, ims: list[PreparedImage], qs: list[str]) -> torch.Tensor:
    reqs = [Request(i, q) for i in range(len(ims)) for q in qs]
    return torch.tensor([s.margin for s in engine.score(ims, reqs)], dtype=torch.float64)


def test_prompt_ids_match_the_processor_expansion(models: Models) -> None:
    ours, tok = models.ours, models.ours.tokenizer
    for im in images(models, [(56, 56), (300, 200)]):
        p = ours.prompts.build(QUESTIONS[1], im)
        text = tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"},
                                          {"type": "text", "text": QUESTIONS[1]}]}],
            tokenize=False, add_generation_prompt=True)
        text = text.replace("<|image_pad|>", "<|image_pad|>" * grid(im).tokens)
        assert list(p.ids) == tok(text, add_special_tokens=False)["input_ids"]
        assert p.ids[p.image_start - 1] == ours.spec.vision_start_id  # type: ignore[attr-defined]
        assert p.ids[p.prefix_len - 1] == ours.spec.vision_end_id  # type: ignore[attr-defined]
        assert p.positions is not None and p.positions.shape == (3, len(p.ids))


def test_logits_match_transformers(models: Models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five sizes and aspect ratios, two questions each, in batches of mixed sizes (a small
    --max-batch-tokens cuts several), the second question after the cached prefix."""
    ims = images(models, SIZES)
    assert len({grid(im).thw for im in ims}) == len(SIZES)
    reqs = [Request(i, q) for i in range(len(ims)) for q in QUESTIONS]
    engine = TorchEngine(models.ours, EngineConfig(max_batch_tokens=300))
    scores, logits, batches = score_with_logits(engine, ims, reqs, monkeypatch)
    assert any(len({grid(ims[reqs[p.req].image]).thw for p in b}) > 1 for b in batches)
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    for k, (r, s) in enumerate(zip(reqs, scores)):
        im = ims[r.image]
        p = models.ours.prompts.build(r.question, im)
        with torch.no_grad():
            want = models.ref(**reference_inputs(models, p.ids, im)).logits[0, -1]
        assert (logits[k] - want).abs().max() <= 1e-4
        ly, ln = want[yes].logsumexp(-1), want[no].logsumexp(-1)
        assert abs(s.margin - float(ly - ln)) <= 1e-4
        assert abs(s.p_yes - float(torch.sigmoid(ly - ln))) <= 1e-5
        assert s.image_tokens == grid(im).tokens


def test_cache_on_equals_cache_off(models: Models) -> None:
    ims = images(models, SIZES[:4], seed=1)
    off = margins(TorchEngine(models.ours, EngineConfig(prefix_cache=False)), ims, QUESTIONS)
    for bs in (1, 16, 64):
        on = TorchEngine(models.ours, EngineConfig(block_size=bs, max_batch_tokens=400))
        assert (margins(on, ims, QUESTIONS) - off).abs().max() <= 1e-5
        assert (margins(on, ims, QUESTIONS) - off).abs().max() <= 1e-5  # all from the cache
        assert on.cache is not None and on.cache.stats.hits > 0


def test_two_images_same_ids_the_write_up_bug(models: Models,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two images of one size: the same placeholder ids, different answers. Keyed on the
    Qwen image's cache key the cache keeps them apart; keyed on ids alone (the 58.com bug)
    image B gets image A's answers."""
    a, b = images(models, [(200, 90), (200, 90)], seed=2)
    assert grid(a) == grid(b) and a.content_hash != b.content_hash
    assert models.ours.prompts.build("q", a).ids == models.ours.prompts.build("q", b).ids
    truth = margins(TorchEngine(models.ours, EngineConfig(prefix_cache=False)), [b], QUESTIONS)
    ours = TorchEngine(models.ours, EngineConfig())
    got_a = margins(ours, [a], QUESTIONS)
    assert (got_a - truth).abs().min() > 1e-3  # the images do answer differently
    assert (margins(ours, [b], QUESTIONS) - truth).abs().max() <= 1e-5
    monkeypatch.setattr(PreparedImage, "cache_key", property(lambda self: "same-for-all"))
    token_only = TorchEngine(models.ours, EngineConfig())
    margins(token_only, [a], QUESTIONS)
    assert torch.allclose(margins(token_only, [b], QUESTIONS), got_a)  # B got A's answers


def test_a_cached_prefix_ending_inside_the_image(models: Models,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a tight cache the chains' tails are evicted first, so followers resume inside
    the image span: embeddings (and Qwen3-VL's DeepStack features) are sliced there, and the
    positions continue from the cached length. Answers equal the cacheless run. A hybrid
    decoder (Qwen3.5) resumes only where a linear-state snapshot was taken, at a prefix's
    end, so never inside the image (``docs/hybrid_cache.md``)."""
    ims = images(models, SIZES, seed=3)
    qs = QUESTIONS + ["red?", "round?"]
    off = margins(TorchEngine(models.ours, EngineConfig(prefix_cache=False)), ims, qs)
    tight = TorchEngine(models.ours, EngineConfig(block_size=4, cache_bytes=12_000))  # 3 slots
    reqs = [Request(i, q) for i in range(len(ims)) for q in qs]
    got, _, batches = score_with_logits(tight, ims, reqs, monkeypatch)
    inside = [p for b in batches for p in b
              if p.span.start < p.past_len < p.span.start + p.span.length]
    assert max(abs(s.margin - float(o)) for s, o in zip(got, off)) <= 1e-5
    if "linear" in models.ours.llm.kinds:
        assert not inside
        return
    assert inside, "no prefix ended inside an image: the test lost its point"
    assert tight.cache is not None and tight.cache.stats.evictions > 0


def test_k_questions_encode_and_prefill_the_image_once(models: Models) -> None:
    (im,) = images(models, [(300, 200)], seed=4)
    engine = TorchEngine(models.ours, EngineConfig())
    engine.score([im], [Request(0, q) for q in ["red?", "Is there a circle?", "no", "blue?"]])
    assert engine.stats.vision_tiles == len(im.rows)  # patch rows, once
    assert engine.stats.image_tokens_prefilled == grid(im).tokens
    engine.score([im], [Request(0, "one more?")])
    assert engine.stats.vision_tiles == len(im.rows)


@pytest.mark.parametrize("cache", [False, True])
def test_greedy_text_matches_generate(models: Models, cache: bool) -> None:
    """Batched greedy decode (positions = sequence index + each prompt's rope delta) over
    prompts of different images and lengths = transformers generate, token for token; only
    every other request asks for text."""
    ims = images(models, [(120, 400), (56, 56)], seed=5)
    reqs = [Request(i, q, 6 if k % 2 == 0 else None) for i in range(2)
            for k, q in enumerate(QUESTIONS)]
    engine = TorchEngine(models.ours, EngineConfig(prefix_cache=cache, max_new_tokens=0))
    scores = engine.score(ims, reqs)
    for r, s in zip(reqs, scores):
        if r.max_new_tokens is None:
            assert s.text is None
            continue
        p = models.ours.prompts.build(r.question, ims[r.image])
        with torch.no_grad():
            out = models.ref.generate(**reference_inputs(models, p.ids, ims[r.image]),
                                      max_new_tokens=6, do_sample=False,
                                      eos_token_id=sorted(engine.runner.stop_ids),
                                      pad_token_id=models.ours.tokenizer.pad_token_id)
        want = models.ours.tokenizer.decode(out[0, len(p.ids):], skip_special_tokens=True)
        assert s.text == want
    assert sum(len(s.text or "") for s in scores) > 4  # the random model does produce text
