"""int4 quantise / pack / Int4Linear, and GPTQ and AWQ against their papers' definitions."""

from __future__ import annotations

import pytest
import torch

from vlmbatch.quant.awq import awq_scale
from vlmbatch.quant.gptq import Hessian, gptq
from vlmbatch.quant.int4 import Int4Linear, dequantize, pack_int32, quant_scale, rtn, unpack_int32


def test_rtn_error_is_at_most_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 3
    q, scale = rtn(w, 64)
    assert q.dtype == torch.int8 and scale.shape == (64, 4)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    err = (dequantize(q, scale, 64) - w).abs()
    assert bool((err <= scale.repeat_interleave(64, 1) / 2 + 1e-6).all())


def test_pack_roundtrip_and_layout() -> None:
    q = torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    packed = pack_int32(q)
    assert packed.shape == (16, 8) and packed.dtype == torch.int32
    assert torch.equal(unpack_int32(packed, 64), q)
    # layout: value j of a word in bits 4j..4j+3, stored as q + 8
    word = int(packed[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [int(v) + 8 for v in q[0, :8]]


def test_pack_matches_compressed_tensors() -> None:
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (32, 128), dtype=torch.int8, generator=g)
    assert torch.equal(pack_int32(q), ct.pack_to_int32(q, 4))
    assert torch.equal(ct.unpack_from_int32(pack_int32(q), 4, q.shape), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_dequantised_weights(dtype: torch.dtype, bias: bool) -> None:
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 256, generator=g), torch.randn(96, generator=g)
    q, scale = rtn(w, 128)
    x = torch.randn(2, 7, 256, generator=g)
    want = x @ dequantize(q, scale, 128).t() + (b if bias else 0)
    lin = Int4Linear(q, scale, b if bias else None, 128, "cpu", dtype)
    assert lin.kernel == "int4pack-cpu"  # torch's CPU int4 kernel, with bf16 activations
    got = lin(x.to(dtype))
    assert got.dtype == dtype and got.shape == (2, 7, 96)
    rel = (got.float() - want).abs().max() / want.abs().max()
    assert rel < 2e-2  # bf16 activations
    lin2 = Int4Linear(q, scale, b if bias else None, 128, "cpu", dtype, use_kernel=False)
    assert lin2.kernel == "unpack"  # the fallback: unpack per call
    assert lin2(x.to(dtype)).float().sub(want).abs().max() / want.abs().max() < 2e-2


def test_hessian_accumulates_two_x_transpose_x_over_n() -> None:
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(5, 16, generator=g), torch.randn(3, 2, 16, generator=g)]
    h = Hessian(16)
    for x in xs:
        h.add(x)
    x = torch.cat([xs[0], xs[1].reshape(-1, 16)]).double()
    torch.testing.assert_close(h.h, 2 * x.t() @ x / len(x))


def test_gptq_with_identity_hessian_is_round_to_nearest() -> None:
    # No correlation between inputs: the inverse Hessian is diagonal, nothing to propagate.
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    q, scale = gptq(w, torch.eye(128), 64, damp=0.0)
    q0, scale0 = rtn(w, 64)
    assert torch.equal(q, q0)
    torch.testing.assert_close(scale, scale0)


def test_gptq_beats_round_to_nearest_on_correlated_inputs() -> None:
    g = torch.Generator().manual_seed(6)
    mix = torch.randn(128, 128, generator=g)
    x = torch.randn(2048, 128, generator=g) @ mix  # correlated calibration inputs
    w = torch.randn(64, 128, generator=g)
    h = Hessian(128)
    h.add(x)
    q, scale = gptq(w, h.h, 32)
    q0, scale0 = rtn(w, 32)
    err = (x @ (w - dequantize(q, scale, 32)).t()).pow(2).mean()
    err0 = (x @ (w - dequantize(q0, scale0, 32)).t()).pow(2).mean()
    assert err < 0.7 * err0, (err, err0)


def test_awq_protects_salient_channels() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1024, 128, generator=g)
    x[:, :4] *= 30  # a few channels carry large activations, as in LLMs
    w = torch.randn(96, 128, generator=g)
    s, err, err_rtn = awq_scale([w[:48], w[48:]], x, 64)
    assert s.shape == (128,) and bool(s[:4].mean() > s[4:].mean())
    assert err < 0.8 * err_rtn
    # the reported error is the real output error of the chosen scales
    q, scale = rtn(w * s, 64)
    real = ((x / s) @ dequantize(q, scale, 64).t() - x @ w.t()).pow(2).mean()
    assert abs(real.item() - err) < 1e-4 * err_rtn + 1e-6


def test_awq_never_worse_than_round_to_nearest() -> None:
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(256, 64, generator=g), torch.randn(32, 64, generator=g)
    _, err, err_rtn = awq_scale([w], x, 32)
    assert err <= err_rtn


def test_group_size_must_divide() -> None:
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant_scale(torch.randn(4, 100), 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,group", [(256, 512, 128), (64, 96, 32)])  # 8 and 2 inner k-tiles
def test_int4_linear_on_cuda_uses_tinygemm(n: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, scale = rtn(w, group)
    lin = Int4Linear(q, scale, b, group, "cuda", torch.bfloat16)
    assert lin.kernel == "int4pack-cuda"
    x = torch.randn(33, k, generator=g)
    want = x @ dequantize(q, scale, group).t() + b
    got = lin(x.to("cuda", torch.bfloat16)).float().cpu()
    assert (got - want).abs().max() / want.abs().max() < 2e-2
