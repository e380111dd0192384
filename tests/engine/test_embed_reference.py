"""Embeddings against transformers (fp32, CPU, random weights): our vectors vs
``InternVLForConditionalGeneration``'s last hidden states (``output_hidden_states``) over the
*whole* prompt, pooled the same way (``engine/pooling.py``'s definitions), then L2.

Tolerances (the issue's): cosine >= 0.99999 and max |difference| <= 1e-5, per vector. Also:
a mask that lets image tokens attend to the whole image (the llama.cpp fork's bug) is caught
by the same check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import InternVLForConditionalGeneration

from tests.conftest import reference_pixels
from vlmbatch.engine.config import EmbedConfig, EngineConfig
from vlmbatch.engine.embed import EmbedHandle
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.pooling import pool_range
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.preprocessing.prepare import prepare

SIZES = [(56, 56), (112, 56), (200, 90), (30, 170)]  # (width, height): 1 to 7 tiles
TEXTS = ["is there a red shape?", "a blue circle", "yes"]


@pytest.fixture(scope="module")
def models(random_model_dir):  # noqa: ANN001, ANN201
    ours = load_model(random_model_dir)
    ref = InternVLForConditionalGeneration.from_pretrained(
        str(random_model_dir), attn_implementation="sdpa").eval()
    rng = np.random.default_rng(0)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in SIZES]
    return ours, ref, images


def requests_for(n_images: int) -> list[EmbedRequest]:
    """Every image alone, every text alone, and two image + text pairs."""
    return ([EmbedRequest(i, None) for i in range(n_images)]
            + [EmbedRequest(None, t) for t in TEXTS]
            + [EmbedRequest(0, TEXTS[0]), EmbedRequest(2, TEXTS[1])])


def reference_hidden(ref, ids: tuple[int, ...], image) -> torch.Tensor:  # noqa: ANN001
    """transformers' last hidden states ``[T, D]`` of the whole prompt."""
    kw = {} if image is None else {"pixel_values": reference_pixels(torch.from_numpy(
        image.tiles))}
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([ids]), output_hidden_states=True, **kw)
    return out.hidden_states[-1][0]


def reference_vectors(emb: EmbedHandle, ref, images, requests) -> list[np.ndarray]:  # noqa: ANN001
    out = []
    for r in requests:
        p = emb.prompt(r, images)
        h = reference_hidden(ref, p.ids, None if r.image is None else images[r.image])
        g = pool_range(p, emb.resolved.pooling, emb.resolved.multi_vector)
        x = h[g.start: g.end]
        v = F.normalize(x, dim=-1) if emb.resolved.multi_vector else F.normalize(x.mean(0), dim=0)
        out.append(v.numpy())
    return out


def assert_close(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(min cosine, max abs diff) of matching rows, asserted within the issue's tolerances."""
    got2, want2 = np.atleast_2d(got), np.atleast_2d(want)
    cos = float((got2 * want2).sum(-1).min())
    diff = float(np.abs(got2 - want2).max())
    assert got.shape == want.shape
    assert cos >= 0.99999 and diff <= 1e-5, (cos, diff)
    return cos, diff


@pytest.mark.parametrize("pooling", ["image-mean", "mean", "last"])
@pytest.mark.parametrize("cache", [True, False])
def test_pooled_vectors_match_transformers(models, pooling: str, cache: bool) -> None:  # noqa: ANN001
    ours, ref, images = models
    engine = TorchEngine(ours, EngineConfig(prefix_cache=cache, max_batch_tokens=400))
    emb = EmbedHandle(engine, EmbedConfig(pooling=pooling))
    requests = requests_for(len(images))
    got = emb.embed(images, requests)
    for g, w in zip(got, reference_vectors(emb, ref, images, requests)):
        assert_close(g.values, w)
    assert [g.tokens for g in got] == [len(emb.prompt(r, images).ids) for r in requests]


def test_multi_vector_matches_transformers(models) -> None:  # noqa: ANN001
    """One unit vector per token of the prompt (InternVL has no projection layer)."""
    ours, ref, images = models
    emb = EmbedHandle(TorchEngine(ours, EngineConfig()), EmbedConfig(multi_vector=True))
    requests = requests_for(len(images))
    got = emb.embed(images, requests)
    for r, g, w in zip(requests, got, reference_vectors(emb, ref, images, requests)):
        assert g.values.shape == (len(emb.prompt(r, images).ids), ours.spec.text.hidden)
        assert_close(g.values, w)


def test_image_span_includes_its_markers(models) -> None:  # noqa: ANN001
    """image-mean pools ``<img>`` .. ``</img>``: the markers' hidden states are in the mean."""
    ours, _, images = models
    emb = EmbedHandle(TorchEngine(ours, EngineConfig()), EmbedConfig(pooling="image-mean"))
    p = emb.prompt(EmbedRequest(1, None), images)
    g = pool_range(p, "image-mean")
    tok = ours.tokenizer
    assert p.ids[g.start] == tok.convert_tokens_to_ids("<img>")
    assert p.ids[g.end - 1] == tok.convert_tokens_to_ids("</img>")
    assert g.end - g.start == p.image_len + 2


def test_bidirectional_image_mask_is_caught(models) -> None:  # noqa: ANN001
    """The llama.cpp fork's bug, injected: each image token attends to the whole image span.
    The vectors then miss the reference by far more than the tolerance (the check can fail);
    ours, causal, are within it."""
    ours, ref, images = models
    emb = EmbedHandle(TorchEngine(ours, EngineConfig(prefix_cache=False)),
                   EmbedConfig(pooling="image-mean"))
    r = EmbedRequest(2, None)  # 3 tiles: 48 image tokens
    p = emb.prompt(r, images)
    want = reference_vectors(emb, ref, images, [r])[0]
    assert_close(emb.embed(images, [r])[0].values, want)
    llm = ours.llm
    with torch.no_grad():
        x = llm.embed_tokens(torch.tensor([p.ids]))
        x[0, p.image_start: p.image_start + p.image_len] = emb.engine.encode([images[2]])[0].embeds
        n = len(p.ids)
        mask = torch.ones(n, n).tril().bool()
        span = slice(p.image_start, p.image_start + p.image_len)
        mask[span, span] = True  # image tokens see later image tokens
        h, _ = llm._layers(x, torch.arange(n)[None], mask[None], None)
        g = pool_range(p, "image-mean")
        buggy = F.normalize(llm.norm(h)[0, g.start: g.end].mean(0), dim=0).numpy()
    with pytest.raises(AssertionError):
        assert_close(buggy, want)
    assert float(np.abs(buggy - want).max()) > 1e-3
