"""Fused projections (``models.layers.fuse_projections``: q/k/v as one ``qkv_proj``, gate/up
as one ``gate_up_proj``, in the decoder and the vision towers) compute what the separate
linears compute, on every family: the reference tests check the separate form against
transformers, this checks the fused form against it (fp32, CPU, random weights with every
parameter perturbed). A fusion in the wrong order (k and v exchanged, gate and up
exchanged) is caught by the same comparison."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import make_model_dir
from tests.models.conftest import Pair
from tests.models.internvl_original_helpers import make_pair, modules
from tests.models.qwen_vl_helpers import rel_err
from vlmbatch.models.decoder import MLP, Attention, TextDecoder
from vlmbatch.models.internvl.vision import VisionLayer
from vlmbatch.models.layers import FusedRMSNorm, fuse_into, fuse_projections

TOL = 1e-6  # relative: max |fused - separate| / max |separate| (measured: 0, bitwise)


def _fused(module: nn.Module) -> nn.Module:
    out = copy.deepcopy(module)
    assert fuse_projections(out) > 0
    assert fuse_projections(out) == 0  # idempotent
    return out


def _positions(llm: TextDecoder, b: int, t: int, start: int) -> torch.Tensor | None:
    """M-RoPE positions of text tokens (the same on every axis), None for 1-D rotary."""
    if llm.spec.rope == "1d":
        return None
    return (start + torch.arange(t))[None, None].expand(3, b, t).contiguous()


def _decoder_outputs(llm: TextDecoder) -> list[torch.Tensor]:
    """Logits and K/V of a ragged prefill, then of a second prefill after it (the past read
    back), the same inputs every call."""
    g = torch.Generator().manual_seed(3)
    d = llm.spec.hidden
    x = torch.randn(3, 9, d, generator=g)
    lengths = torch.tensor([9, 6, 3])
    with torch.no_grad():
        logits, kv = llm.prefill(x, lengths, positions=_positions(llm, 3, 9, 0))
        out = [logits, *(t for pair in kv for t in pair)]
        if "linear" in llm.kinds:  # a hybrid's states need the engine's padding rules
            return out
        y = torch.randn(3, 4, d, generator=g)
        more, _ = llm.prefill(y, torch.tensor([4, 2, 1]), kv, lengths,
                              positions=_positions(llm, 3, 4, 9))
    return [*out, more]


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(rel_err(x, y) for x, y in zip(a, b, strict=True))


def _internvl_tiles(vision: nn.Module, n: int = 3) -> torch.Tensor:
    s = vision.spec.image_size
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, 256, (n, s, s, 3), generator=g, dtype=torch.uint8)


@pytest.fixture(scope="module")
def internvl_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF-native Qwen2 text and InternViT with q/k/v biases; Qwen3 text (InternVL3.5:
    QK-norm); the original layout with InternLM2 (grouped ``wqkv``: only its MLP fuses) and
    with the 6B-style InternViT (RMS norm, QK-norm over the width, no q/k/v biases)."""
    root = tmp_path_factory.mktemp("fusion")
    return {"internvl_qwen2": make_model_dir(root / "qwen2"),
            "internvl3_5_qwen3": make_pair(root / "q3", "internvl3_5_qwen3")[1],
            "internvl2_internlm2": make_pair(root / "lm2", "internvl2_internlm2")[1],
            "vit6b_hermes_qwen2": make_pair(root / "v6", "vit6b_hermes_qwen2")[1]}


@pytest.mark.parametrize("kind", ["internvl_qwen2", "internvl3_5_qwen3",
                                  "internvl2_internlm2", "vit6b_hermes_qwen2"])
def test_internvl_fused_equals_separate(internvl_dirs: dict[str, Path], kind: str) -> None:
    vision, llm = modules(internvl_dirs[kind])
    assert _worst(_decoder_outputs(_fused(llm)), _decoder_outputs(llm)) <= TOL
    tiles = _internvl_tiles(vision)
    with torch.no_grad():
        assert rel_err(_fused(vision)(tiles), vision(tiles)) <= TOL


def test_qwen_vl_fused_equals_separate(pair: Pair) -> None:
    """Qwen2-VL, Qwen2.5-VL (its gated vision MLP fuses), Qwen3-VL, Qwen3.5 (gated
    attention: the query, gate, key and value rows in one projection)."""
    llm = pair.ours.text
    assert _worst(_decoder_outputs(_fused(llm)), _decoder_outputs(llm)) <= TOL
    grids = [(1, 4, 6), (1, 2, 2)]
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (28, pair.ours.spec.vision.row_size), generator=g,
                      dtype=torch.uint8)
    vision = pair.ours.vision
    fused = copy.deepcopy(vision)
    fuse_projections(fused)  # only Qwen2.5-VL's has something to fuse
    with torch.no_grad():
        assert rel_err(fused(x, grids).embeds, vision(x, grids).embeds) <= TOL


def _misfused(module: nn.Module) -> nn.Module:
    """A copy fused in the wrong order: k and v exchanged (the same widths under GQA),
    gate and up exchanged."""
    out = copy.deepcopy(module)
    for m in out.modules():
        if isinstance(m, (Attention, VisionLayer)) and hasattr(m, "k_proj"):
            fuse_into(m, "qkv_proj", ("q_proj", "v_proj", "k_proj"))
        elif isinstance(m, MLP) and hasattr(m, "gate_proj"):
            fuse_into(m, "gate_up_proj", ("up_proj", "gate_proj"))
    return out


def test_a_fusion_in_the_wrong_order_is_caught(internvl_dirs: dict[str, Path]) -> None:
    """The fault the comparison above exists for: measured relative errors ~0.1-1."""
    vision, llm = modules(internvl_dirs["internvl_qwen2"])
    assert _worst(_decoder_outputs(_misfused(llm)), _decoder_outputs(llm)) > 100 * TOL
    tiles = _internvl_tiles(vision)
    with torch.no_grad():
        assert rel_err(_misfused(vision)(tiles), vision(tiles)) > 100 * TOL
    mlp_only = copy.deepcopy(llm)
    for m in mlp_only.modules():
        if isinstance(m, MLP):
            fuse_into(m, "gate_up_proj", ("up_proj", "gate_proj"))
    assert _worst(_decoder_outputs(mlp_only), _decoder_outputs(llm)) > 100 * TOL


def test_fused_names_record_their_parts(internvl_dirs: dict[str, Path]) -> None:
    """What ``quant.runtime`` maps a checkpoint's per-part int4 tensors by."""
    _, llm = modules(internvl_dirs["internvl_qwen2"])
    fused = _fused(llm)
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attn.fusions == {"qkv_proj": (("q_proj", 32), ("k_proj", 16), ("v_proj", 16))}
    assert mlp.fusions == {"gate_up_proj": (("gate_proj", 64), ("up_proj", 64))}
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.bias is not None


def test_float32_rms_norm_with_its_weight_in_one_op_is_bitwise_the_same() -> None:
    """``FusedRMSNorm`` in float32 passes its weight to ``rms_norm`` (one op, no casts)."""
    norm = FusedRMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 7, 48)
    want = norm.weight * torch.nn.functional.rms_norm(x.float(), (48,), eps=1e-6).to(x.dtype)
    assert torch.equal(norm(x), want)
