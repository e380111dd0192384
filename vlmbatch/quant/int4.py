"""Symmetric group-wise int4 weights: quantise, pack (compressed-tensors layout), and a
W4A16 linear that runs on them.

Conventions (the ones compressed-tensors' ``pack-quantized`` format and so vLLM/LMDeploy use):

- A weight ``W [N, K]`` (out, in) is split along K into groups of ``group_size`` columns;
  each (row, group) has one scale, ``scale [N, K/group_size]``.
- ``q = clamp(round(W / scale), -8, 7)``, ``scale = max|W_group| / 7.5`` (compressed-tensors'
  symmetric rule: half the int4 range), so ``W ~ q * scale``.
- Packed: eight values per int32 along K, value ``j`` of a word in bits ``4j..4j+3``, stored
  as ``q + 8`` (unsigned), ``weight_packed [N, K/8] int32``.

``Int4Linear`` keeps only 4-bit weights in memory. On CPU it uses torch's weight-packed int4
matmul (``aten._weight_int4pack_mm_for_cpu``); on CUDA torch's tinygemm kernel
(``aten._weight_int4pack_mm``). Both run 16-bit activations (W4A16): a float32 model's
activations are cast to bfloat16 for the matmul and back (the CPU kernel's float32 path
measured 60x slower than bf16 at 4096x128x384). Either kernel is used only after a probe
matmul agrees with dequantised weights, else the layer unpacks its weights per call (still
W4 in memory, slower). ``Int4Linear.kernel`` says which path a layer took.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QMIN, QMAX = -8, 7


def quant_scale(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [N, K]`` -> per-group scales ``[N, K/group_size]`` (float32)."""
    n, k = w.shape
    check_groups(k, group_size)
    amax = w.float().reshape(n, k // group_size, group_size).abs().amax(-1)
    return (amax / ((QMAX - QMIN) / 2)).clamp(min=1e-10)


def quantize(w: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [N, K]`` with ``scale [N, G]`` -> int8 ``q [N, K]`` in [-8, 7]."""
    s = scale.float().repeat_interleave(group_size, dim=1)
    return torch.clamp(torch.round(w.float() / s), QMIN, QMAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().repeat_interleave(group_size, dim=1)).to(dtype)


def rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: ``w [N, K]`` -> (q int8 [N, K], scale [N, G])."""
    scale = quant_scale(w, group_size)
    return quantize(w, scale, group_size), scale


def check_groups(k: int, group_size: int) -> None:
    if group_size <= 0 or k % group_size or group_size % 8:
        raise ValueError(f"in_features {k} must be a multiple of group_size {group_size}, "
                         "itself a multiple of 8; pick --group-size among the divisors of "
                         "the model's hidden and intermediate sizes")


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q [N, K]`` in [-8, 7] -> int32 ``[N, K/8]`` (compressed-tensors layout)."""
    n, k = q.shape
    u = (q.to(torch.int64) + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    word = (u << shifts).sum(-1)  # < 2**32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int32(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of ``pack_int32``: int32 ``[N, K/8]`` -> int8 ``[N, K]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    u = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    return (u.reshape(packed.shape[0], -1)[:, :k] - 8).to(torch.int8)


class Int4Linear(nn.Module):
    """``y = x @ dequant(q, scale).T + bias`` with 4-bit weights in memory.

    x: ``[..., K]`` of the layer's dtype; returns ``[..., N]``.
    """

    nibbles: torch.Tensor | None  # [N, K/2] uint8 (the unpack path) or None (a kernel's)
    scale: torch.Tensor  # [N, K/group_size]
    bias: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, use_kernel: bool = True) -> None:
        super().__init__()
        device = torch.device(device)
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.dtype = dtype
        q = q.to(device)
        scale = scale.to(device)
        u = (q.to(torch.int32) + 8)
        # fallback storage: two values per byte, [N, K/2] uint8
        self.register_buffer("nibbles", (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(device, dtype).clone())
        self.kernel = "unpack"
        if use_kernel:
            self._try_kernel(u, scale, device)

    def _try_kernel(self, u: torch.Tensor, scale: torch.Tensor, device: torch.device) -> None:
        ops = torch.ops.aten
        try:
            # tinygemm layout: scales_and_zeros [G, N, 2]; w = (u - 8) * scale + zero, zero = 0
            sz = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous()
            act = torch.float16 if self.dtype == torch.float16 else torch.bfloat16
            if device.type == "cpu":
                packed = ops._convert_weight_to_int4pack_for_cpu(u, 2)
                run = ops._weight_int4pack_mm_for_cpu
            elif device.type == "cuda" and act == torch.bfloat16:
                # tinygemm: K a multiple of inner_k_tiles * 16 (2, 4 or 8 tiles), N of 8
                inner = next((t for t in (8, 4, 2) if self.in_features % (16 * t) == 0), None)
                if inner is None or self.out_features % 8:
                    return
                packed = ops._convert_weight_to_int4pack(
                    (u[:, 0::2] << 4 | u[:, 1::2]).to(torch.uint8), inner)
                run = ops._weight_int4pack_mm
            else:
                return
            sz = sz.to(act)
            probe = torch.randn(3, self.in_features, device=device, dtype=act)
            want = probe.float() @ self._dequant().float().t()
            got = run(probe, packed, self.group_size, sz).float()
            if (got - want).abs().max() > 2e-2 * max(want.abs().max().item(), 1.0):
                return
        except (RuntimeError, NotImplementedError):
            return
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", sz)
        self.register_buffer("nibbles", None)
        self._run = run
        self.act_dtype = act
        self.kernel = f"int4pack-{device.type}"

    def _dequant(self) -> torch.Tensor:
        n = self.nibbles
        assert n is not None, "a layer on a kernel keeps no nibbles"
        u = torch.stack([n & 0xF, n >> 4], -1).reshape(self.out_features, self.in_features)
        q = u.to(torch.int8) - 8
        return dequantize(q, self.scale, self.group_size, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "unpack":
            return F.linear(x, self._dequant(), self.bias)
        shape = x.shape
        y = self._run(x.reshape(-1, self.in_features).to(self.act_dtype).contiguous(),
                      self.packed, self.group_size, self.scales_zeros)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}")
