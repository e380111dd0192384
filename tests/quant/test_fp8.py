"""FP8 W8A8 (e4m3) linears: rounding, the reference path against a hand-written formula, error
against float, a converted Qwen2 decoder, and (GPU) torch._scaled_mm against the reference.

Error figures measured here (seeded random data, CPU, torch 2.13):
- weight round trip: per element at most 2^-4 = 6.25% of |w| in e4m3's normal range (measured
  max 5.9%), at most 2^-10 of the row scale below it (subnormals); RMS relative error 2.6%;
- Fp8Linear (K 512, weights and activations quantised) against nn.Linear: relative error
  (Frobenius) 3.7%, cosine 0.9993 (bound 0.999);
- a 2-layer Qwen2 decoder (models/decoder.py's TextDecoder, hidden 64) with its 14 linears
  converted: logits cosine >= 0.99992 per row (bound 0.999), relative error 0.8-1.3%,
  |dP(yes)| 0.0033 (bound 0.01).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.models.decoder import TextDecoder, TextSpec
from vlmbatch.quant.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    Fp8Unavailable,
    convert_linears_fp8,
    dequantize_rows,
    quantize_rows,
    require_fp8,
)


def e4m3_grid() -> torch.Tensor:
    """The non-negative finite e4m3fn values by code 0..126 (0x7F is NaN): subnormals
    m * 2^-9 (exponent field 0), normals 2^(e - 7) * (1 + m / 8); bias 7, 3 mantissa bits."""
    vals = [(c & 7) * 2.0**-9 if c >> 3 == 0 else 2.0 ** ((c >> 3) - 7) * (1 + (c & 7) / 8)
            for c in range(127)]
    return torch.tensor(vals, dtype=torch.float64)


def hand_e4m3(v: torch.Tensor) -> torch.Tensor:
    """``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to the even code, float64."""
    grid = e4m3_grid()
    a = v.double().abs()
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    tie = torch.where(lo % 2 == 0, lo, hi)
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, tie))
    return torch.sign(v.double()) * grid[pick]


def test_grid_is_torchs_e4m3() -> None:
    assert e4m3_grid()[-1] == FP8_MAX == torch.finfo(FP8).max
    codes = torch.arange(127, dtype=torch.uint8).view(FP8).double()
    assert torch.equal(codes, e4m3_grid())


def test_cast_rounds_to_nearest_even_as_by_hand() -> None:
    g = torch.Generator().manual_seed(0)
    grid = e4m3_grid()
    mid = ((grid[1:] + grid[:-1]) / 2).float()  # every tie, exactly representable
    v = torch.cat([mid, -mid, torch.randn(4096, generator=g) * 50,
                   torch.rand(1024, generator=g) * 2**-6])  # normals and subnormals
    assert torch.equal(v.to(FP8).double(), hand_e4m3(v))


def test_weight_round_trip_error_bound() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * torch.rand(256, 1, generator=g) * 3
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (256, 1) and scale.dtype == torch.float32
    err = (dequantize_rows(q, scale) - w).abs()
    # half a step: 2^-4 of |w| in the normal range, 2^-10 of the scale below it (2^-9 spacing)
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert bool((err <= bound).all())
    # each row's largest |w| maps to 448 and comes back
    i = w.abs().argmax(1)
    rows = torch.arange(256)
    assert bool((q[rows, i].float().abs() == FP8_MAX).all())
    torch.testing.assert_close(dequantize_rows(q, scale)[rows, i], w[rows, i])
    assert (err.norm() / w.norm()).item() < 0.03  # measured 0.026


def test_zero_rows_do_not_make_nan() -> None:
    q, scale = quantize_rows(torch.zeros(3, 32))
    assert bool((scale > 0).all()) and bool((dequantize_rows(q, scale) == 0).all())


@pytest.mark.parametrize("bias", [False, True])
def test_reference_equals_hand_formula(bias: bool) -> None:
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(5, 48, generator=g), torch.randn(24, 48, generator=g), torch.randn(24)
    sx = x.abs().amax(-1, keepdim=True) / 448  # float32, per token
    sw = w.abs().amax(-1, keepdim=True) / 448  # float32, per output channel
    xd = hand_e4m3(x / sx) * sx.double()  # [5, 48]
    wd = hand_e4m3(w / sw) * sw.double()  # [24, 48]
    want = torch.einsum("mk,nk->mn", xd, wd) + (b.double() if bias else 0)
    lin = Fp8Linear(w, b if bias else None, backend="reference")
    got = lin(x)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_fp8_linear_close_to_float() -> None:
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    lin = nn.Linear(512, 256)
    x = torch.randn(4, 33, 512, generator=g)
    f = Fp8Linear.from_linear(lin)
    assert f.backend == "reference"  # the CPU's
    y0, y1 = lin(x).detach(), f(x)
    assert y1.shape == (4, 33, 256)
    cos = F.cosine_similarity(y0.flatten(), y1.flatten(), dim=0).item()
    rel = ((y1 - y0).norm() / y0.norm()).item()
    assert cos >= 0.999, cos  # measured 0.9993
    assert rel < 0.045, rel  # measured 0.037
    y2 = f(x.to(torch.bfloat16))  # a bf16 model's activations: output in bf16
    assert y2.dtype == torch.bfloat16
    assert F.cosine_similarity(y1.flatten(), y2.float().flatten(), dim=0) > 0.999


def _tiny_qwen2() -> TextDecoder:
    torch.manual_seed(0)
    spec = TextSpec(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                    intermediate=128, eps=1e-6, rope_theta=1e4, tie_embeddings=True)
    return TextDecoder(spec).eval()


def test_converted_qwen2_decoder_close_to_float() -> None:
    lm = _tiny_qwen2()
    q = copy.deepcopy(lm)
    names = convert_linears_fp8(q)
    assert len(names) == 14 and "lm_head" not in names  # 7 per layer; the tied head kept
    assert q.lm_head.weight is q.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 20), generator=g)
    lengths = torch.tensor([20, 17, 12, 5])  # right-padded batch, as the engine's
    with torch.inference_mode():
        e = lm.embed_tokens(ids)
        a, b = lm.prefill(e, lengths)[0], q.prefill(e, lengths)[0]  # [4, V]
    cos = F.cosine_similarity(a, b, dim=-1)
    assert bool((cos >= 0.999).all()), cos  # measured >= 0.99992
    p_a, p_b = torch.sigmoid(a[:, 3] - a[:, 4]), torch.sigmoid(b[:, 3] - b[:, 4])
    assert (p_a - p_b).abs().max() < 0.01  # measured 0.0033


def test_convert_include_exclude() -> None:
    lm = _tiny_qwen2()
    names = convert_linears_fp8(lm, include=["layers.0.*"], exclude=["*down_proj"])
    assert names == [f"layers.0.{n}" for n in
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")]
    attn0, attn1 = lm.layers[0].self_attn, lm.layers[1].self_attn
    assert isinstance(attn0.q_proj, Fp8Linear)
    assert isinstance(lm.layers[0].mlp.down_proj, nn.Linear)
    assert isinstance(attn1.q_proj, nn.Linear)
    assert attn0.q_proj.bias is not None and attn0.o_proj.bias is None
    assert convert_linears_fp8(lm, include=["layers.0.*"]) == ["layers.0.mlp.down_proj"]


def test_model_dtype_cast_keeps_fp8_weights_and_scales() -> None:
    """``model.to(bf16)`` casts every floating buffer; the e4m3 weight and its float32 scales
    must come through unchanged (only the bias follows the model's dtype)."""
    torch.manual_seed(6)
    lin = nn.Linear(64, 32)
    f = Fp8Linear.from_linear(lin)
    w, s = f.weight_fp8.clone(), f.weight_scale.clone()
    f.to(torch.bfloat16)
    assert f.weight_fp8.dtype == FP8 and torch.equal(f.weight_fp8.view(torch.uint8),
                                                      w.view(torch.uint8))
    assert f.weight_scale.dtype == torch.float32 and torch.equal(f.weight_scale, s)
    assert f.bias is not None and f.bias.dtype == torch.bfloat16
    x = torch.randn(3, 64)
    assert f(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_require_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    assert require_fp8("cpu") == "reference"
    with pytest.raises(Fp8Unavailable, match="CUDA"):
        require_fp8("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Fp8Unavailable, match="sees no CUDA"):
        require_fp8("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(Fp8Unavailable, match="capability 8.0; FP8 matmuls need >= 8.9"):
        require_fp8("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert require_fp8("cuda:0") == "scaled_mm"


def test_unknown_backend_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        Fp8Linear(torch.randn(16, 16), None, backend="cutlass")


@pytest.mark.parametrize("k,n", [(512, 256), (40, 24)])  # the second padded to 48 x 32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_operands_on_cpu_kernel(k: int, n: int, dtype: torch.dtype) -> None:
    """The CUDA path's operand preparation (padding, layouts, scale shapes, bias), run on
    torch's CPU ``_scaled_mm`` as a stand-in: this checks our side of the call, not a GPU."""
    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(k, n).to(dtype)
    x = torch.randn(7, k, generator=g).to(dtype)
    mm = Fp8Linear.from_linear(lin, backend="scaled_mm")
    kp, np_ = mm.weight_fp8.shape[1], mm.weight_fp8.shape[0]
    assert kp % 16 == 0 and np_ % 16 == 0 and kp >= k and np_ >= n
    assert mm.weight_fp8.t().stride() == (1, kp)  # the second operand column-major
    try:
        got = mm(x)
    except (RuntimeError, NotImplementedError) as e:  # a CPU build without row-wise scaling
        pytest.skip(f"torch._scaled_mm on the CPU: {e}")
    want = Fp8Linear.from_linear(lin, backend="reference")(x)
    assert got.dtype == dtype and got.shape == (7, n)
    assert (got.float() - want.float()).abs().max() <= 1e-5 * want.float().abs().max()


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs CUDA with compute capability >= 8.9")
@pytest.mark.parametrize("k,n,bias", [(512, 256, True), (896, 4864, False), (40, 24, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_reference_on_cuda(k: int, n: int, bias: bool,
                                            dtype: torch.dtype) -> None:
    """_scaled_mm and the reference share the quantised operands; they differ only in the
    accumulation order and, in bf16, the output's rounding (at most one bf16 step, 2^-7)."""
    assert require_fp8("cuda") == "scaled_mm"
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(k, n, bias=bias).to("cuda", dtype)
    x = torch.randn(33, k, generator=g).to("cuda", dtype)
    mm = Fp8Linear.from_linear(lin)
    assert mm.backend == "scaled_mm"
    got = mm(x).float()
    want = Fp8Linear.from_linear(lin, backend="reference")(x).float()
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs CUDA with compute capability >= 8.9")
def test_converted_decoder_on_cuda_equals_reference() -> None:
    lm = _tiny_qwen2().to("cuda", torch.bfloat16)
    ref, mm = copy.deepcopy(lm), copy.deepcopy(lm)
    convert_linears_fp8(ref, backend="reference")
    convert_linears_fp8(mm)  # scaled_mm on this GPU
    ids = torch.randint(0, 128, (4, 20), device="cuda")
    lengths = torch.tensor([20, 17, 12, 5], device="cuda")
    with torch.inference_mode():
        e = lm.embed_tokens(ids)
        a, b = ref.prefill(e, lengths)[0], mm.prefill(e, lengths)[0]
    assert bool((F.cosine_similarity(a, b, dim=-1) >= 0.9999).all())
