"""Qwen-VL embeddings (jina-embeddings-v4's layout and pooling) against transformers (fp32,
CPU, tiny random checkpoints with our tokenizer, ``tests/models/qwen_vl_helpers.py``).

The reference is ``...ForConditionalGeneration`` run on the *whole* prompt (ids from our
prompt builder, uint8 patch rows normalised as the image processor does, the image's grid
and ``mm_token_type_ids``, so transformers makes its own M-RoPE positions), its
``hidden_states[-1]`` pooled by the definition written out here, then L2. Tolerances (the
issue's): cosine >= 0.99999 and max |difference| <= 1e-5 per vector. Negative controls: the
span without its markers, the hidden states before the final norm, and (Qwen3-VL) the
prefill without DeepStack all miss the same check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_embed_reference import assert_close
from tests.models.qwen_vl_helpers import KINDS, reference_pixels, save_engine_checkpoint
from vlmbatch.engine.config import EmbedConfig, EngineConfig
from vlmbatch.engine.embed import EmbedHandle
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import ImageOptions, LoadedModel
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid

SIZES = [(56, 56), (200, 90), (30, 170), (300, 200)]  # (width, height): aspect ratios 1 to 1:6
TEXTS = ["is there a red shape?", "a blue circle", "yes"]


@dataclass
class Models:
    path: Path
    ours: LoadedModel
    ref: torch.nn.Module
    images: list[PreparedImage]


@pytest.fixture(scope="module")
def all_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Models]:
    from transformers import AutoModelForImageTextToText

    out = {}
    for kind in KINDS:
        path = save_engine_checkpoint(kind, tmp_path_factory.mktemp(kind))
        ours = load_model(path)
        plan = ours.family.image_plan(ours.spec, ImageOptions("reduced", None, 1.0, None))
        rng = np.random.default_rng(0)
        images = [plan.prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                  for w, h in SIZES]
        ref = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
        out[kind] = Models(path, ours, ref, images)
    return out


@pytest.fixture(params=KINDS)
def models(request: pytest.FixtureRequest, all_models: dict[str, Models]) -> Models:
    return all_models[request.param]


def requests_for(n_images: int) -> list[EmbedRequest]:
    """Every image alone, every text alone, and two image + text pairs."""
    return ([EmbedRequest(i, None) for i in range(n_images)]
            + [EmbedRequest(None, t) for t in TEXTS]
            + [EmbedRequest(0, TEXTS[0]), EmbedRequest(2, TEXTS[1])])


def reference_hidden(m: Models, ids: tuple[int, ...], im: PreparedImage | None
                     ) -> torch.Tensor:
    """transformers' ``hidden_states[-1]`` ``[T, D]`` of the whole prompt."""
    x = torch.tensor([ids])
    kw: dict = {}
    if im is not None:
        assert isinstance(im.grid, PatchGrid)
        v = m.ours.spec.vision  # type: ignore[attr-defined]
        kw = dict(mm_token_type_ids=(x == m.ours.spec.image_token_id).int(),
                  pixel_values=reference_pixels(torch.from_numpy(im.rows), v.mean, v.std),
                  image_grid_thw=torch.tensor([im.grid.thw]))
    with torch.no_grad():
        out = m.ref(input_ids=x, output_hidden_states=True, use_cache=False, **kw)
    return out.hidden_states[-1][0]


def jina_span(ids: tuple[int, ...], start_id: int, end_id: int, markers: bool = True
              ) -> slice:
    """jina-embeddings-v4's image positions, found in the ids: ``<|vision_start|>`` ..
    ``<|vision_end|>`` both included (``markers=False``: the pads only, a wrong span)."""
    a, b = ids.index(start_id), ids.index(end_id)
    return slice(a, b + 1) if markers else slice(a + 1, b)


def reference_vector(m: Models, ids: tuple[int, ...], im: PreparedImage | None, pooling: str,
                     markers: bool = True) -> np.ndarray:
    """The pooled vector by the definitions (docs/embeddings.md), on transformers' states."""
    h = reference_hidden(m, ids, im)
    spec = m.ours.spec
    if pooling == "last":
        x = h[-1:]
    elif pooling == "image-mean" and im is not None:
        x = h[jina_span(ids, spec.vision_start_id, spec.vision_end_id,  # type: ignore[attr-defined]
                        markers)]
    else:  # mean, or image-mean of a text alone: every real token
        x = h
    return F.normalize(x.mean(0), dim=0).numpy()


def reference_vectors(emb: EmbedHandle, m: Models, reqs: list[EmbedRequest],
                      pooling: str) -> list[np.ndarray]:
    return [reference_vector(m, emb.prompt(r, m.images).ids,
                             None if r.image is None else m.images[r.image], pooling)
            for r in reqs]


@pytest.mark.parametrize("pooling", ["image-mean", "mean", "last"])
@pytest.mark.parametrize("cache", [True, False])
def test_pooled_vectors_match_transformers(models: Models, pooling: str, cache: bool) -> None:
    """Four sizes, three texts and two image + text inputs in one call (a small
    --max-batch-tokens cuts it into several batches of mixed grids)."""
    engine = TorchEngine(models.ours, EngineConfig(prefix_cache=cache, max_batch_tokens=300))
    emb = EmbedHandle(engine, EmbedConfig(pooling=pooling))
    reqs = requests_for(len(models.images))
    got = emb.embed(models.images, reqs)
    for g, w in zip(got, reference_vectors(emb, models, reqs, pooling)):
        assert_close(g.values, w)
    assert [g.tokens for g in got] == [len(emb.prompt(r, models.images).ids) for r in reqs]


def test_default_pooling_is_image_mean(models: Models) -> None:
    emb = EmbedHandle(TorchEngine(models.ours, EngineConfig()), EmbedConfig())
    assert emb.resolved.pooling == "image-mean" and not emb.resolved.multi_vector


def test_multi_vector_matches_transformers(models: Models) -> None:
    """One unit vector per token of the whole prompt (no projection in these checkpoints)."""
    emb = EmbedHandle(TorchEngine(models.ours, EngineConfig()), EmbedConfig(multi_vector=True))
    reqs = requests_for(len(models.images))
    for r, g in zip(reqs, emb.embed(models.images, reqs)):
        ids = emb.prompt(r, models.images).ids
        h = reference_hidden(models, ids, None if r.image is None else models.images[r.image])
        assert g.values.shape == (len(ids), models.ours.spec.text.hidden)
        assert_close(g.values, F.normalize(h, dim=-1).numpy())


def test_batched_equals_one_at_a_time(models: Models) -> None:
    emb = EmbedHandle(TorchEngine(models.ours, EngineConfig(prefix_cache=False)), EmbedConfig())
    reqs = requests_for(len(models.images))
    together = emb.embed(models.images, reqs)
    for r, t in zip(reqs, together):
        alone = emb.embed(models.images, [r])[0]
        assert float(np.abs(alone.values - t.values).max()) <= 1e-6


def test_image_prompt_is_jinas(models: Models) -> None:
    """The layout of jina-embeddings-v4's processor, token for token: one user turn, the
    image, the image prompt, no assistant turn; a text alone is its own tokens."""
    emb = EmbedHandle(TorchEngine(models.ours, EngineConfig()), EmbedConfig())
    tok = models.ours.tokenizer
    im = models.images[1]
    assert isinstance(im.grid, PatchGrid)
    p = emb.prompt(EmbedRequest(1, None), models.images)
    text = ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * im.grid.tokens
            + "<|vision_end|>Describe the image.<|im_end|>\n")
    assert list(p.ids) == tok(text, add_special_tokens=False)["input_ids"]
    assert p.ids[p.image_start - 1] == models.ours.spec.vision_start_id  # type: ignore[attr-defined]
    assert p.ids[p.image_start + p.image_len] == models.ours.spec.vision_end_id  # type: ignore[attr-defined]
    q = emb.prompt(EmbedRequest(None, TEXTS[0]), models.images)
    assert list(q.ids) == tok(TEXTS[0], add_special_tokens=False)["input_ids"]


def test_hidden_states_last_is_after_the_final_norm(models: Models) -> None:
    """What transformers 5's ``hidden_states[-1]`` is for these models: the final norm of the
    last decoder layer's output (= ``last_hidden_state``), not that output itself."""
    ref, caught = models.ref, []
    lm = ref.model.language_model
    handle = lm.layers[-1].register_forward_hook(lambda mod, i, o: caught.append(
        o[0] if isinstance(o, tuple) else o))
    try:
        h = reference_hidden(models, (1, 2, 3, 4, 5), None)
    finally:
        handle.remove()
    before = caught[0][0]
    assert torch.allclose(h, lm.norm(before), atol=1e-6)
    assert float((h - before).abs().max()) > 1e-2


def test_wrong_span_and_missing_norm_are_caught(models: Models) -> None:
    """The check can fail: the pads without their markers, or our states before the final
    norm, miss the tolerance by far."""
    emb = EmbedHandle(TorchEngine(models.ours, EngineConfig(prefix_cache=False)),
                   EmbedConfig(pooling="image-mean"))
    r = EmbedRequest(2, None)
    ids = emb.prompt(r, models.images).ids
    got = emb.embed(models.images, [r])[0].values
    no_markers = reference_vector(models, ids, models.images[2], "image-mean", markers=False)
    with pytest.raises(AssertionError):
        assert_close(got, no_markers)
    want = reference_vector(models, ids, models.images[2], "image-mean")
    assert_close(got, want)
    llm, norm = models.ours.llm, models.ours.llm.norm
    llm.norm = torch.nn.Identity()  # type: ignore[assignment]
    try:
        with pytest.raises(AssertionError):
            assert_close(emb.embed(models.images, [r])[0].values, want)
    finally:
        llm.norm = norm


def test_deepstack_is_applied(all_models: dict[str, Models],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-VL: without DeepStack in the hidden-state prefill the vectors miss."""
    m = all_models["qwen3_vl"]
    engine = TorchEngine(m.ours, EngineConfig(prefix_cache=False))
    emb = EmbedHandle(engine, EmbedConfig(pooling="image-mean"))
    r = EmbedRequest(1, None)
    want = reference_vector(m, emb.prompt(r, m.images).ids, m.images[1], "image-mean")
    assert_close(emb.embed(m.images, [r])[0].values, want)
    spans = engine.runner._image_spans
    monkeypatch.setattr(engine.runner, "_image_spans", lambda *a: (spans(*a), None)[1])
    with pytest.raises(AssertionError):
        assert_close(emb.embed(m.images, [r])[0].values, want)


def test_jina_projector_matches_transformers(all_models: dict[str, Models],
                                             tmp_path: Path) -> None:
    """A ``multi_vector_projector`` (jina-v4's name) added to a Qwen2.5-VL checkpoint: each
    token's vector is the projection of transformers' ``hidden_states[-1]``, then L2; the
    checkpoint now declares itself an embedding model, still pooled unless asked."""
    import shutil

    from safetensors.torch import save_file

    m = all_models["qwen2_5_vl"]
    path = tmp_path / "jina"
    shutil.copytree(m.path, path)
    torch.manual_seed(0)
    w, b = torch.randn(128, m.ours.spec.text.hidden) * 0.1, torch.randn(128) * 0.1
    save_file({"multi_vector_projector.weight": w, "multi_vector_projector.bias": b},
              str(path / "projector.safetensors"))
    ours = load_model(path)
    pooled = EmbedHandle(TorchEngine(ours, EngineConfig()), EmbedConfig())
    assert pooled.resolved.spec.declared and not pooled.resolved.multi_vector
    emb = EmbedHandle(TorchEngine(ours, EngineConfig()), EmbedConfig(multi_vector=True))
    reqs = [EmbedRequest(1, None), EmbedRequest(None, TEXTS[1])]
    for r, g in zip(reqs, emb.embed(m.images, reqs)):
        ids = emb.prompt(r, m.images).ids
        h = reference_hidden(m, ids, None if r.image is None else m.images[r.image])
        assert g.values.shape == (len(ids), 128)
        assert_close(g.values, F.normalize(h @ w.T + b, dim=-1).numpy())


def test_embedding_after_classification_reuses_its_kv(models: Models) -> None:
    """``last`` pooling after a question about the same images: nothing encoded or prefilled
    again inside the images (the embedding prompt's prefix is the yes/no prompt's with this
    chat template), and the vectors equal a cacheless run's."""
    from vlmbatch.engine.records import Request

    emb = EmbedHandle(TorchEngine(models.ours, EngineConfig()), EmbedConfig(pooling="last"))
    stats, ims = emb.engine.stats, models.images[:2]
    emb.engine.score(ims, [Request(0, "is there a red shape?"), Request(1, "a circle?")])
    rows, image_tokens = stats.vision_tiles, stats.image_tokens_prefilled
    reqs = [EmbedRequest(0, None), EmbedRequest(1, None)]
    got = emb.embed(ims, reqs)
    assert stats.vision_tiles == rows and stats.image_tokens_prefilled == image_tokens
    cold = EmbedHandle(TorchEngine(models.ours, EngineConfig(prefix_cache=False)),
                    EmbedConfig(pooling="last")).embed(ims, reqs)
    for g, c in zip(got, cold):
        assert float(np.abs(g.values - c.values).max()) <= 1e-5
