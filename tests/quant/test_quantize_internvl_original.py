"""``vlmbatch quantize`` (AWQ/GPTQ W4A16) and ``--llm-quant int8-dynamic`` on an original-layout
InternVL2 checkpoint with an InternLM2 decoder (``tests/models/internvl_original_helpers.py``):
the fused grouped ``wqkv`` is one group read after ``attention_norm`` (AWQ folds its scale
there; ``wo`` is not folded, its input being the value rows interleaved in ``wqkv``), the
checkpoint keeps InternLM2's own key names, loads with every decoder linear as
``Int4Linear``, and answers agree with the float model on >= 95% of the example questions
(group size 16, as ``test_quantize_qwen_vl.py`` says why). Measured agreement on the
examples: AWQ 1.0, GPTQ 1.0, int8-dynamic 1.0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.models.internvl_original_helpers import make_pair
from tests.quant.test_quantize_qwen_vl import EXAMPLES, agreement, answers
from vlmbatch.cli.quantize import quantize_model
from vlmbatch.engine.loading import load_model
from vlmbatch.models.decoder import DecoderLayer, TextSpec
from vlmbatch.models.layers import rotary
from vlmbatch.quant.calibrate import apply_scale, layer_groups, layer_linear
from vlmbatch.quant.int4 import Int4Linear

# InternLM2's decoder-layer linears, by their names in the original checkpoint
LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
           "feed_forward.w3")


@pytest.fixture(scope="module")
def internlm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    original = make_pair(tmp_path_factory.mktemp("internlm2"), "internvl2_internlm2")[1]
    return original, answers(original)


def quantised_like_float(src: Path, want: list[dict], out: Path, method: str) -> None:
    out = quantize_model(src, out, method, EXAMPLES, samples=16, group_size=16,
                         progress=False).out
    packed = sorted(k for k in load_file(str(out / "model.safetensors"))
                    if k.endswith(".weight_packed"))
    assert packed == sorted(f"language_model.model.layers.{i}.{name}.weight_packed"
                            for i in range(2) for name in LINEARS)
    assert {type(m) for layer in load_model(out).llm.layers
            for m in (layer.self_attn.wqkv, layer.self_attn.o_proj, layer.mlp.down_proj)} \
        == {Int4Linear}
    assert agreement(answers(out), want) >= 0.95, method


def test_gptq_on_an_internlm2_checkpoint(internlm2: tuple[Path, list[dict]],
                                         tmp_path: Path) -> None:
    quantised_like_float(*internlm2, tmp_path / "gptq", "gptq")


@pytest.mark.slow
def test_awq_on_an_internlm2_checkpoint(internlm2: tuple[Path, list[dict]],
                                        tmp_path: Path) -> None:
    """Slow (~20 s); its folds are checked in CI by the unit test below."""
    quantised_like_float(*internlm2, tmp_path / "awq", "awq")


def test_int8_dynamic_internlm2_answers_like_float(internlm2: tuple[Path, list[dict]]) -> None:
    src, want = internlm2
    assert agreement(answers(src, llm_quant="int8-dynamic"), want) >= 0.95


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_awq_folding_keeps_a_grouped_layer_output(heads: int, kv_heads: int) -> None:
    """The grouped layout's folds (into attention_norm for wqkv, post-attention norm, w3's
    rows) leave the layer's float output unchanged; ``wo`` is never folded."""
    spec = TextSpec(vocab=10, hidden=32, layers=1, heads=heads, kv_heads=kv_heads,
                    head_dim=32 // heads, intermediate=64, eps=1e-6, rope_theta=1e4,
                    tie_embeddings=False, qkv_layout="grouped", qkv_bias=True)
    torch.manual_seed(0)
    layer = DecoderLayer(spec).eval()
    x = torch.randn(2, 5, 32)
    cos, sin = rotary(torch.arange(5)[None].expand(2, 5), spec.head_dim, spec.rope_theta,
                      x.dtype)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        ref, _ = layer(x, cos, sin, mask)
        groups = [g for g in layer_groups(heads, kv_heads, "grouped") if g.producer]
        for g in groups:
            n = layer_linear(layer, g.linears[0])[1].in_features
            apply_scale(layer, g, torch.rand(n) * 3 + 0.2)
        got, _ = layer(x, cos, sin, mask)
    assert [g.linears for g in groups] == [("wqkv",), ("gate_proj", "up_proj"), ("down_proj",)]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
