"""ColQwen2 checkpoints (``model_type: colqwen2``) against transformers' ``ColQwen2ForRetrieval``
(fp32, CPU, random weights built and saved here: a tiny Qwen2-VL or Qwen2.5-VL inside it,
a 128-dim ``embedding_proj_layer``, our tokenizer).

What is compared, per token: our multi-vector output (the default for this checkpoint) with
``ColQwen2ForRetrieval(...).embeddings`` on the same ids (the processor's, checked equal to
ours) and uint8 patch rows. Positions: transformers' ``ColQwen2ForRetrieval`` calls its
inner model with ``inputs_embeds`` and no ``image_grid_thw``, so without ``position_ids``
it turns every token with the 1-D index (all three M-RoPE axes equal); Qwen2-VL's own
forward, and the colpali-engine code the checkpoints were trained with (which calls it with
``input_ids`` and ``image_grid_thw``), use M-RoPE image positions. We use M-RoPE; the reference
is given transformers' own ``get_rope_index`` positions, and a test measures the gap to
the positions-less call (images only: a text's M-RoPE positions are the 1-D index).
Tolerances: cosine >= 0.99999 and max |diff| <= 1e-5 per token vector; MaxSim 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.engine.test_embed_reference import assert_close
from tests.models.qwen_vl_helpers import reference_pixels, save_colqwen2_checkpoint
from vlmbatch.engine.config import EmbedConfig, EngineConfig
from vlmbatch.engine.embed import EmbedHandle
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.pooling import maxsim
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import ImageOptions, LoadedModel
from vlmbatch.models.config_io import read_config
from vlmbatch.models.embedding import read_embedding_spec
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid

KINDS = ("qwen2_vl", "qwen2_5_vl")
SIZES = [(56, 56), (200, 90), (30, 170), (300, 200)]  # (width, height)
QUERIES = ["is there a red shape?", "a blue circle", "yes"]


@dataclass
class Col:
    path: Path
    ours: LoadedModel
    ref: torch.nn.Module  # ColQwen2ForRetrieval
    arrays: list[np.ndarray]
    images: list[PreparedImage]


@pytest.fixture(scope="module")
def all_cols(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Col]:
    from transformers import ColQwen2ForRetrieval

    out = {}
    for kind in KINDS:
        path = save_colqwen2_checkpoint(kind, tmp_path_factory.mktemp("colqwen2_" + kind))
        ours = load_model(path)
        plan = ours.family.image_plan(ours.spec, ImageOptions("reduced", None, 1.0, None))
        rng = np.random.default_rng(1)
        arrays = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in SIZES]
        ref = ColQwen2ForRetrieval.from_pretrained(str(path)).eval()
        out[kind] = Col(path, ours, ref, arrays, [plan.prepare(a) for a in arrays])
    return out


@pytest.fixture(params=KINDS)
def col(request: pytest.FixtureRequest, all_cols: dict[str, Col]) -> Col:
    return all_cols[request.param]


def requests_for(n_images: int) -> list[EmbedRequest]:
    return ([EmbedRequest(i, None) for i in range(n_images)]
            + [EmbedRequest(None, q) for q in QUERIES])


def reference_embeddings(col: Col, ids: tuple[int, ...], im: PreparedImage | None,
                         mrope: bool = True) -> torch.Tensor:
    """``ColQwen2ForRetrieval(...).embeddings[0]`` ``[T, 128]`` for one prompt; with
    ``mrope`` given transformers' ``get_rope_index`` positions (module docstring)."""
    x = torch.tensor([ids])
    kw: dict = dict(input_ids=x, attention_mask=torch.ones_like(x))
    if im is not None:
        assert isinstance(im.grid, PatchGrid)
        v = col.ours.spec.vision  # type: ignore[attr-defined]
        grid = torch.tensor([im.grid.thw])
        kw.update(pixel_values=reference_pixels(torch.from_numpy(im.rows), v.mean, v.std)[None],
                  image_grid_thw=grid)
        if mrope:
            kw["position_ids"] = col.ref.vlm.get_rope_index(
                x, mm_token_type_ids=(x == col.ours.spec.image_token_id).int(),
                image_grid_thw=grid, attention_mask=kw["attention_mask"])[0]
    with torch.no_grad():
        return col.ref(**kw).embeddings[0]


def test_loads_as_its_inner_model_with_a_projection(col: Col) -> None:
    """The inner kind's numerics, the projection found by name, multi-vector by default."""
    assert col.ours.spec.model_type == col.ref.config.vlm_config.model_type
    spec = read_embedding_spec(col.path, read_config(col.path), col.ours.family.default_pooling,
                               col.ours.family.multi_vector_default)
    assert spec.projection == "embedding_proj_layer" and spec.declared and spec.multi_vector
    emb = EmbedHandle(TorchEngine(col.ours, EngineConfig()), EmbedConfig())
    assert emb.resolved.multi_vector
    (v,) = emb.embed([], [EmbedRequest(None, "a red circle")])
    assert v.values.shape == (v.tokens, 128)  # every token through the 128-wide projection
    pooled = EmbedHandle(TorchEngine(col.ours, EngineConfig()), EmbedConfig(pooling="mean"))
    assert not pooled.resolved.multi_vector  # asking for a pooling asks for one vector


def test_prompts_are_the_processors(col: Col) -> None:
    """Our ids = ``ColQwen2Processor``'s: ``process_images`` (its visual prompt, the pads
    expanded for the same grid) and ``process_queries`` (``Query: `` + text + 10 pad
    tokens + newline): the same token set, so every token vector can be compared."""
    from transformers import ColQwen2Processor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    pre = col.ours.spec.preprocess  # type: ignore[attr-defined]
    v = col.ours.spec.vision  # type: ignore[attr-defined]
    proc = ColQwen2Processor(
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=pre.patch, merge_size=pre.merge, temporal_patch_size=pre.temporal,
            image_mean=list(v.mean), image_std=list(v.std), min_pixels=pre.min_pixels,
            max_pixels=pre.max_pixels),
        tokenizer=col.ours.tokenizer)
    emb = EmbedHandle(TorchEngine(col.ours, EngineConfig()), EmbedConfig())
    for i, a in enumerate(col.arrays):
        theirs = proc.process_images([Image.fromarray(a)])
        assert theirs["image_grid_thw"][0].tolist() == list(col.images[i].grid.dims)
        assert list(emb.prompt(EmbedRequest(i, None), col.images).ids) == \
            theirs["input_ids"][0].tolist()
    for q in QUERIES:
        assert list(emb.prompt(EmbedRequest(None, q), col.images).ids) == \
            proc.process_queries([q])["input_ids"][0].tolist()


@pytest.mark.parametrize("cache", [True, False])
def test_token_vectors_match_colqwen2(col: Col, cache: bool) -> None:
    """Every image and query in one call (several batches), each token's unit vector."""
    engine = TorchEngine(col.ours, EngineConfig(prefix_cache=cache, max_batch_tokens=300))
    emb = EmbedHandle(engine, EmbedConfig())
    reqs = requests_for(len(col.images))
    for r, g in zip(reqs, emb.embed(col.images, reqs)):
        ids = emb.prompt(r, col.images).ids
        want = reference_embeddings(col, ids, None if r.image is None else col.images[r.image])
        assert g.values.shape == (len(ids), 128)
        assert_close(g.values, want.numpy())


def test_wrong_positions_or_projection_miss(col: Col) -> None:
    """The check can fail: the positions-less call's image vectors (1-D positions) are not
    ours, nor are ours with the projection's bias dropped."""
    emb = EmbedHandle(TorchEngine(col.ours, EngineConfig(prefix_cache=False)), EmbedConfig())
    r = EmbedRequest(1, None)
    ids = emb.prompt(r, col.images).ids
    got = emb.embed(col.images, [r])[0].values
    one_d = reference_embeddings(col, ids, col.images[1], mrope=False).numpy()
    with pytest.raises(AssertionError):
        assert_close(got, one_d)
    projection = emb.engine._head(emb.cfg).projection  # the fault goes in the engine's head
    assert projection is not None and projection.bias is not None
    with torch.no_grad():
        projection.bias.zero_()
    with pytest.raises(AssertionError):
        assert_close(emb.embed(col.images, [r])[0].values,
                     reference_embeddings(col, ids, col.images[1]).numpy())


def test_queries_match_the_positions_less_call(col: Col) -> None:
    """A query has no image: M-RoPE = the 1-D index, so even transformers' default call
    (no ``position_ids``) gives our vectors."""
    emb = EmbedHandle(TorchEngine(col.ours, EngineConfig()), EmbedConfig())
    for q in QUERIES:
        r = EmbedRequest(None, q)
        want = reference_embeddings(col, emb.prompt(r, col.images).ids, None, mrope=False)
        assert_close(emb.embed(col.images, [r])[0].values, want.numpy())


def test_maxsim_equals_score_retrieval(col: Col) -> None:
    """``vlmbatch.maxsim`` on our vectors = ``ColQwen2Processor.score_retrieval`` on
    transformers' (and on ours)."""
    from transformers import ColQwen2Processor

    emb = EmbedHandle(TorchEngine(col.ours, EngineConfig()), EmbedConfig())
    docs_r = [EmbedRequest(i, None) for i in range(len(col.images))]
    q_r = [EmbedRequest(None, q) for q in QUERIES]
    ours_d = [g.values for g in emb.embed(col.images, docs_r)]
    ours_q = [g.values for g in emb.embed(col.images, q_r)]
    ref_d = [reference_embeddings(col, emb.prompt(r, col.images).ids, col.images[r.image])
             for r in docs_r if r.image is not None]
    ref_q = [reference_embeddings(col, emb.prompt(r, col.images).ids, None) for r in q_r]
    score = ColQwen2Processor.score_retrieval  # uses no processor state
    theirs = score(None, ref_q, ref_d).numpy()  # type: ignore[arg-type]
    on_ours = score(None, [torch.from_numpy(x) for x in ours_q],  # type: ignore[arg-type]
                    [torch.from_numpy(x) for x in ours_d]).numpy()
    got = maxsim(ours_q, ours_d)
    assert got.shape == (len(QUERIES), len(col.images))
    assert float(np.abs(got - theirs).max()) <= 1e-4, np.abs(got - theirs).max()
    assert float(np.abs(got - on_ours).max()) <= 1e-5
