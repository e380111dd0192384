"""The embedder's own properties (random weights, fp32, CPU): batched == one at a time, each
sequence causal (an image token never sees a later one), the prefix cache shared with the
yes/no path and counted, Matryoshka truncation, options and the drive loop's errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from vlmbatch.engine.config import ConfigError, EmbedConfig, EngineConfig
from vlmbatch.engine.embed import EmbedHandle
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import EmbedRequest, Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.embedding import read_embedding_spec
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import prepare_group, prepared_groups, run_group
from vlmbatch.pipeline.records import EmbedItem, ErrorKind
from vlmbatch.pipeline.task import EmbedTask
from vlmbatch.preprocessing.prepare import prepare

SIZES = [(56, 56), (200, 90), (112, 56), (30, 170), (90, 200)]


@pytest.fixture(scope="module")
def model(random_model_dir):  # noqa: ANN001, ANN201
    return load_model(random_model_dir)


@pytest.fixture(scope="module")
def images(model):  # noqa: ANN001, ANN201
    rng = np.random.default_rng(1)
    return [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), model.spec.tiling)
            for w, h in SIZES]


def embedder(model, cfg: EmbedConfig | None = None, **engine) -> EmbedHandle:  # noqa: ANN001
    return EmbedHandle(TorchEngine(model, EngineConfig(**engine)), cfg or EmbedConfig())


MIXED = ([EmbedRequest(i, None) for i in range(5)] + [EmbedRequest(None, "a red circle"),
         EmbedRequest(None, "is there a blue square in the image?"), EmbedRequest(3, "yes")])


@pytest.mark.parametrize("cfg", [EmbedConfig(), EmbedConfig(pooling="last"),
                                 EmbedConfig(multi_vector=True)])
def test_batched_equals_one_at_a_time(model, images, cfg: EmbedConfig) -> None:  # noqa: ANN001
    """Inputs of different lengths in one padded batch give each input's own vector."""
    together = embedder(model, cfg, prefix_cache=False).embed(images, MIXED)
    for r, v in zip(MIXED, together):
        alone = embedder(model, cfg, prefix_cache=False).embed(images, [r])[0]
        assert v.values.shape == alone.values.shape
        assert np.abs(v.values - alone.values).max() <= 1e-6


def test_image_tokens_never_see_later_image_tokens(model, images) -> None:  # noqa: ANN001
    """Two images that differ in their last tile only (the thumbnail): every token before
    that tile has the same hidden state in both; with the fork's bidirectional image mask
    every image token would see the last tile and differ."""
    a = images[1]
    assert a.grid.num_tiles > 1
    tiles = a.tiles.copy()
    tiles[-1] = 255 - tiles[-1]
    b = dataclasses.replace(a, rows=tiles, content_hash="other")
    emb = embedder(model, EmbedConfig(multi_vector=True), prefix_cache=False)
    va, vb = (v.values for v in emb.embed([a, b], [EmbedRequest(0, None), EmbedRequest(1, None)]))
    p = emb.prompt(EmbedRequest(0, None), [a])
    last_tile = p.image_start + p.image_len - model.spec.tokens_per_tile
    assert np.abs(va[:last_tile] - vb[:last_tile]).max() <= 1e-6
    assert np.abs(va[last_tile:] - vb[last_tile:]).max() > 1e-3


def test_embedding_after_classification_reuses_its_kv(model, images) -> None:  # noqa: ANN001
    """`last` pooling needs no hidden state inside the image prefix: an image just asked a
    question is neither encoded nor its image tokens prefilled again, and its vector equals
    a cacheless one."""
    emb = embedder(model, EmbedConfig(pooling="last"))
    engine, stats = emb.engine, emb.engine.stats
    engine.score(images[:2], [Request(0, "is there a red shape?"), Request(1, "a circle?")])
    tiles, image_tokens = stats.vision_tiles, stats.image_tokens_prefilled
    got = emb.embed(images[:2], [EmbedRequest(0, None), EmbedRequest(1, None)])
    assert stats.vision_tiles == tiles  # nothing encoded
    assert stats.image_tokens_prefilled == image_tokens  # no image token computed again
    want = embedder(model, EmbedConfig(pooling="last"), prefix_cache=False).embed(
        images[:2], [EmbedRequest(0, None), EmbedRequest(1, None)])
    for g, w in zip(got, want):
        assert np.abs(g.values - w.values).max() <= 1e-5


def test_classification_after_embedding_reuses_its_kv(model, images) -> None:  # noqa: ANN001
    """image-mean pooling reads the image span's hidden states, so it cannot take cached KV
    there; it caches the prefix it computes, and a question asked next finds it all."""
    emb = embedder(model)
    engine, stats = emb.engine, emb.engine.stats
    engine.score(images[:1], [Request(0, "is there a red shape?")])
    before = stats.image_tokens_prefilled
    emb.embed(images[:1], [EmbedRequest(0, None)])
    assert stats.image_tokens_prefilled - before == (images[0].grid.num_tiles
                                                      * model.spec.tokens_per_tile)
    for i in (1, 2):
        emb.embed(images, [EmbedRequest(i, None)])
    tiles, image_tokens = stats.vision_tiles, stats.image_tokens_prefilled
    scores = engine.score(images, [Request(1, "is there a red shape?"),
                                   Request(2, "a circle?")])
    assert stats.vision_tiles == tiles and stats.image_tokens_prefilled == image_tokens
    cold = TorchEngine(model, EngineConfig(prefix_cache=False)).score(
        images, [Request(1, "is there a red shape?"), Request(2, "a circle?")])
    assert max(abs(s.margin - c.margin) for s, c in zip(scores, cold)) <= 1e-5


def test_matryoshka_dimensions(model, images, tmp_path: Path) -> None:  # noqa: ANN001
    """The first N components, re-normalised; refused unless declared or forced."""
    with pytest.raises(ConfigError, match="declares no Matryoshka sizes"):
        embedder(model, EmbedConfig(dimensions=16))
    full = embedder(model).embed(images, MIXED[:3])
    cut = embedder(model, EmbedConfig(dimensions=16, force_dimensions=True)).embed(
        images, MIXED[:3])
    for f, c in zip(full, cut):
        want = f.values[:16] / np.linalg.norm(f.values[:16])
        assert c.values.shape == (16,) and np.abs(c.values - want).max() <= 1e-6
    assert read_embedding_spec(model.spec.path, {"matryoshka_dims": [16, 8]},
                               "image-mean").matryoshka_dims == (8, 16)


def test_vectors_are_unit_and_prefixes_are_text(model, images) -> None:  # noqa: ANN001
    emb = embedder(model, EmbedConfig(query_prefix="Query: ", document_prefix="Passage: ",
                                      prompt="What is shown?"))
    vs = emb.embed(images, MIXED)
    assert all(abs(np.linalg.norm(v.values) - 1) < 1e-5 and v.values.dtype == np.float32
               for v in vs)
    tok = model.tokenizer
    assert emb.prompt(EmbedRequest(None, "a"), images).ids == tuple(tok.encode("Query: a"))
    assert vs[5].tokens == len(tok.encode("Query: a red circle"))
    with_image = tok.decode(emb.prompt(EmbedRequest(0, "a"), images).ids)
    assert with_image.endswith("</img>\nPassage: a<|im_end|>\n")
    assert tok.decode(emb.prompt(EmbedRequest(0, None), images).ids).endswith(
        "</img>\nWhat is shown?<|im_end|>\n")


def test_options_are_checked() -> None:
    for bad in (dict(pooling="max"), dict(dimensions=0), dict(force_dimensions=True),
                dict(multi_vector=True, dimensions=8), dict(prompt=" ")):
        with pytest.raises(ConfigError):
            EmbedConfig(**bad)  # type: ignore[arg-type]


def test_drive_loop_keeps_failures_per_item(model, images, tmp_path: Path) -> None:  # noqa: ANN001
    """A missing image fails its item only; text items and good images are embedded, in
    order; the threaded and the serial preparation agree."""
    good = tmp_path / "good.png"
    import cv2
    cv2.imwrite(str(good), np.full((40, 60, 3), 90, np.uint8))
    items = [EmbedItem(0, "t", None, "a red circle", tmp_path),
             EmbedItem(1, "missing", "nope.png", None, tmp_path),
             EmbedItem(2, "g", "good.png", "both", tmp_path),
             EmbedItem(3, None, "good.png", None, tmp_path)]
    emb = embedder(model)
    task = EmbedTask(emb.cfg)
    serial = [e for (e,) in run_group(task, emb.engine,
                                      prepare_group(task, items, emb.image_plan))]
    assert [e.index for e in serial] == [0, 1, 2, 3]
    assert serial[1].vector is None and serial[1].error_kind is ErrorKind.SOURCE
    assert all(e.vector is not None for e in (serial[0], serial[2], serial[3]))
    threaded = [e for p in prepared_groups(task, [items[:2], items[2:]], emb.image_plan,
                                           PrepareOptions(10**8, 2))
                for (e,) in run_group(task, emb.engine, p)]
    for a, b in zip(serial, threaded):
        assert a.error == b.error
        if a.vector is not None:
            assert np.abs(a.vector - b.vector).max() <= 1e-6


def test_engine_failure_fails_the_group(model, images, monkeypatch) -> None:  # noqa: ANN001
    emb = embedder(model)
    monkeypatch.setattr(emb.engine.runner, "hidden", lambda *a: 1 / 0)
    items = [EmbedItem(0, None, None, "a", Path.cwd()), EmbedItem(1, None, None, "b", Path.cwd())]
    task = EmbedTask(emb.cfg)
    out = [e for (e,) in run_group(task, emb.engine, prepare_group(task, items, emb.image_plan))]
    assert all(e.error_kind is ErrorKind.ENGINE and "ZeroDivisionError" in (e.error or "")
               for e in out)
