"""bench/flops.py: against a hand count of a tiny spec, and against FlopCounterMode on our modules.

FlopCounterMode counts matrix products (mm, addmm, bmm, convolution) and SDPA kernels, with
no causal saving; so the comparison uses ``causal=False`` (the full masked rectangle) and runs
attention on SDPA's math backend, whose matmuls it counts: torch 2.13 has no flop formula for
the CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) that runs otherwise.
Like with like, the counts agree exactly (tolerance 0).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench.flops import attended_keys, prefill_flops, vision_tile_flops, workload_flops
from vlmbatch.engine.loading import load_model
from vlmbatch.models.decoder import TextSpec
from vlmbatch.models.internvl.vision import VisionSpec

TINY_VISION = VisionSpec(
    hidden=8, layers=2, heads=2, intermediate=16, patch=2, image_size=4,
    norm_type="layer_norm", eps=1e-6, qk_norm=False, act="gelu", mean_pooling=True,
    feature_layer=-1, drop_cls=True, downsample=0.5, projector_act="gelu", text_hidden=6,
    mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
TINY_TEXT = TextSpec(vocab=10, hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4,
                     intermediate=12, eps=1e-6, rope_theta=1e4, tie_embeddings=True)


def test_vision_hand_count() -> None:
    # 4 x 4 tile, patch 2: g = 2, 4 patches + CLS = L 5 tokens, C 8, I 16, 2 layers;
    # pixel shuffle 0.5: 1 token of 4C = 32 channels; text hidden D 6
    f = vision_tile_flops(TINY_VISION, 4)
    assert f.patch_embed == 2 * 4 * (3 * 2 * 2) * 8 == 768
    assert f.qkv_o == 2 * (4 * 2 * 5 * 8 * 8) == 5120  # q, k, v, o: 4 of 2*L*C*C per layer
    assert f.attention == 2 * (2 * 2 * 5 * 5 * 8) == 1600  # scores + x V: 2 of 2*L*L*C
    assert f.mlp == 2 * (2 * 2 * 5 * 8 * 16) == 5120  # fc1 + fc2: 2 of 2*L*C*I
    assert f.projector == 2 * 1 * 32 * 6 + 2 * 1 * 6 * 6 == 456
    assert f.total == 13064


def test_prefill_hand_count() -> None:
    # D 8, 2 query heads and 1 KV head of d 4, I 12, V 10, 1 layer; 3 new after 2 cached
    f = prefill_flops(TINY_TEXT, new=3, cached=2)
    per_token = 2 * 8 * 8 + 2 * 2 * 8 * 4 + 2 * 8 * 8 + 3 * 2 * 8 * 12  # q, k+v, o, MLP
    assert per_token == 960 and f.linears == 3 * 960
    # causal: the new tokens see 3, 4, 5 keys = 12; each key 4 * H * d (scores + x V)
    assert attended_keys(3, 2) == 12 and f.attention == 4 * 2 * 4 * 12 == 384
    assert f.lm_head == 2 * 8 * 10  # last token only
    assert f.total == 3424
    dense = prefill_flops(TINY_TEXT, new=3, cached=2, causal=False)
    assert attended_keys(3, 2, causal=False) == 15 and dense.attention == 4 * 2 * 4 * 15


def test_attention_grows_with_context() -> None:
    short = prefill_flops(TINY_TEXT, new=4, cached=0)
    long = prefill_flops(TINY_TEXT, new=4, cached=100)
    assert long.linears == short.linears and long.lm_head == short.lm_head
    assert long.attention - short.attention == 4 * 2 * 4 * 4 * 100  # 4 tokens x 100 more keys


def _counted(fn) -> int:  # noqa: ANN001
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), \
            FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_vision_matches_flop_counter(random_model_dir) -> None:  # noqa: ANN001
    m = load_model(random_model_dir)
    tile = m.spec.tiling.tile_size
    tiles = torch.randint(0, 256, (3, tile, tile, 3), dtype=torch.uint8)
    assert _counted(lambda: m.vision(tiles)) == 3 * vision_tile_flops(m.spec.vision, tile).total


@pytest.mark.parametrize("new,cached", [(11, 0), (11, 7), (1, 40)])
def test_prefill_matches_flop_counter(random_model_dir,  # noqa: ANN001
                                     new: int, cached: int) -> None:
    m = load_model(random_model_dir)
    t = m.spec.text
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, new, t.hidden, generator=g)
    past = None
    if cached:
        past = [(torch.randn(1, t.kv_heads, cached, t.head_dim, generator=g),
                 torch.randn(1, t.kv_heads, cached, t.head_dim, generator=g))
                for _ in range(t.layers)]
    counted = _counted(lambda: m.llm.prefill(x, torch.tensor([new]), past,
                                             torch.tensor([cached]) if cached else None))
    assert counted == prefill_flops(t, new, cached, causal=False).total
    # the causal count the bench reports is the rectangle less the masked triangle
    saved = t.layers * 4 * t.heads * t.head_dim * new * (new - 1) // 2
    assert prefill_flops(t, new, cached).total == counted - saved


def test_workload_adds_vision_and_prefills(random_model_dir) -> None:  # noqa: ANN001
    spec = load_model(random_model_dir).spec
    tile = vision_tile_flops(spec.vision, spec.tiling.tile_size).total
    pre = prefill_flops(spec.text, 30, 0).total + prefill_flops(spec.text, 5, 25).total
    assert workload_flops(spec, 2, [(30, 0), (5, 25)]) == 2 * tile + pre
