"""FP8 W8A8 linears (e4m3): per-output-channel weight scales, per-token dynamic activation
scales, ``torch._scaled_mm`` on GPUs that have FP8 matrix units.

Arithmetic (both paths)::

    weight  W [N, K]:  s_w[n] = max_k |W[n, k]| / 448,  Wq = e4m3(W / s_w)        (offline)
    input   x [M, K]:  s_x[m] = max_k |x[m, k]| / 448,  xq = e4m3(x / s_x)        (per call)
    output  y [M, N] = s_x[m] * s_w[n] * sum_k xq[m, k] * Wq[n, k] + b[n]

448 is e4m3's largest finite value (``torch.float8_e4m3fn``, no infinities: a value past it
would become NaN, so the quotient is clamped first). ``e4m3(.)`` rounds to nearest, ties to
even. Scales are float32; an all-zero row gets a tiny scale instead of 0 (no NaN).

Paths (``Fp8Linear.backend``):

- ``"scaled_mm"``: CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell).
  ``torch._scaled_mm(xq, Wq.t(), scale_a=s_x [M, 1], scale_b=s_w [1, N], bias, out_dtype)``,
  the row-wise recipe of torch 2.13 (``aten::_scaled_mm(Tensor self, Tensor mat2, Tensor
  scale_a, Tensor scale_b, Tensor? bias=None, Tensor? scale_result=None, ScalarType?
  out_dtype=None, bool use_fast_accum=False)``; checks in ``torch/_meta_registrations.py``
  ``_check_scaled_mm_sizes``): the first operand row-major, the second column-major (``Wq`` is
  stored ``[N, K]`` contiguous, so ``Wq.t()`` is), K and N multiples of 16 (M free), both
  scales float32 and contiguous, out_dtype bf16, fp16 or fp32; a bias only with a 16-bit
  output, of the output's dtype. Layers whose K or N is not a multiple of 16 are padded with
  zeros (weights once, at build; activations per call, before quantising: a zero changes no
  row's max); a float32 model's output comes out in float32 and its bias is added after.
- ``"reference"``: everywhere else (CPU). The same quantisation (the same function), then
  both operands dequantised and multiplied in float32: the numbers the GPU computes, up to
  accumulation order and the output's rounding. It is slow and is there to test, not to
  serve. (torch 2.13's CPU build also has a ``_scaled_mm``, tensor- and row-wise; it is not
  used: the reference is written out so that a test can read what it computes.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = 1e-12  # amax floor: an all-zero row gets scale 1e-12 / 448, not 0


class Fp8Unavailable(RuntimeError):
    """FP8 matmuls are not available on this device."""


def require_fp8(device: torch.device | str) -> str:
    """The backend ``--quant fp8`` would use on ``device``, or Fp8Unavailable saying why not.

    ``"scaled_mm"`` on CUDA with compute capability >= 8.9; ``"reference"`` on the CPU, which
    only checks numbers (dequantised float32 matmuls: slower than float, no memory saved while
    computing); anything else raises.
    """
    d = torch.device(device)
    if d.type == "cpu":
        return "reference"
    if d.type != "cuda":
        raise Fp8Unavailable(f"--quant fp8 on {d}: FP8 linears run on CUDA (compute capability "
                             ">= 8.9) or, as a slow reference, on the CPU")
    if not torch.cuda.is_available():
        raise Fp8Unavailable(f"--quant fp8 on {d}: torch {torch.__version__} sees no CUDA "
                             "device; use a CUDA build on a machine with a GPU")
    major, minor = torch.cuda.get_device_capability(d)
    if (major, minor) < (8, 9):
        raise Fp8Unavailable(
            f"--quant fp8 on {d}: {torch.cuda.get_device_name(d)} has compute capability "
            f"{major}.{minor}; FP8 matmuls need >= 8.9 (Ada, Hopper or newer). Use "
            "--quant none (bf16) there")
    if not hasattr(torch, "_scaled_mm"):
        raise Fp8Unavailable(f"--quant fp8: torch {torch.__version__} has no torch._scaled_mm")
    return "scaled_mm"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` -> (``xq [R, K]`` e4m3, ``scale [R, 1]`` float32), one scale per row:
    ``x ~ xq * scale``. Weights (rows = output channels) and activations (rows = tokens)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_rows`` up to rounding: float32 ``q * scale``."""
    return q.float() * scale


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with e4m3 weights and per-token e4m3 activations.

    x: ``[..., K]`` (any float dtype); returns ``[..., N]`` in x's dtype. The backend (and so
    the padding) is fixed at build: build on the device that serves. The weight and its scales
    are kept as integer bit patterns (uint8, int32) so that a model's ``.to(dtype)`` moves
    them but never casts them (it casts every floating buffer, e4m3 included); the bias
    follows the model's dtype.
    """

    weight_bits: torch.Tensor  # [N, K] e4m3 as uint8 ("reference"), [Np, Kp] zero-padded
    scale_bits: torch.Tensor  # [N] or [Np] float32 as int32
    bias: torch.Tensor | None  # [N]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 backend: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.backend = backend or require_fp8(weight.device)
        if self.backend not in ("scaled_mm", "reference"):
            raise ValueError(f"backend {self.backend!r} not one of scaled_mm, reference")
        w = weight.detach()
        if self.backend == "scaled_mm":  # K and N padded to multiples of 16
            kp, np_ = _round16(self.in_features), _round16(self.out_features)
            w = F.pad(w.float(), (0, kp - self.in_features, 0, np_ - self.out_features))
        q, scale = quantize_rows(w)
        self.register_buffer("weight_bits", q.contiguous().view(torch.uint8))
        self.register_buffer("scale_bits", scale.reshape(-1).contiguous().view(torch.int32))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight_fp8(self) -> torch.Tensor:
        """``[N, K]`` (or padded ``[Np, Kp]``) e4m3, row-major."""
        return self.weight_bits.view(FP8)

    @property
    def weight_scale(self) -> torch.Tensor:
        """``[N]`` (or ``[Np]``) float32 per-output-channel scales."""
        return self.scale_bits.view(torch.float32)

    @classmethod
    def from_linear(cls, lin: nn.Linear, backend: str | None = None) -> Fp8Linear:
        return cls(lin.weight, lin.bias, backend)

    @classmethod
    def cat(cls, parts: Sequence[Fp8Linear]) -> Fp8Linear | None:
        """One layer computing ``parts`` side by side (``models.layers.cat_linears``): the
        weight scales are per output row, so each row keeps its bits and scale and the
        joined layer is the parts exactly (activations are quantised per token, the same
        for every part). None for parts of different backends or inputs."""
        first = parts[0]
        bias = [p.bias for p in parts]
        if (len({(p.backend, p.in_features) for p in parts}) != 1
                or (any(b is None for b in bias) and not all(b is None for b in bias))):
            return None
        rows = sum(p.out_features for p in parts)
        bits = torch.cat([p.weight_bits[: p.out_features] for p in parts])
        scales = torch.cat([p.scale_bits[: p.out_features] for p in parts])
        if first.backend == "scaled_mm":  # padded rows as the constructor pads: zeros
            pad = _round16(rows) - rows
            bits = F.pad(bits, (0, 0, 0, pad))
            tiny = torch.full((pad,), _TINY / FP8_MAX, device=scales.device)
            scales = torch.cat([scales, tiny.view(torch.int32)])
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.out_features, out.in_features, out.backend = rows, first.in_features, first.backend
        out.register_buffer("weight_bits", bits.contiguous())
        out.register_buffer("scale_bits", scales.contiguous())
        out.register_buffer("bias", None if bias[0] is None else torch.cat(bias))  # type: ignore[arg-type]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        y = self._scaled_mm(x2) if self.backend == "scaled_mm" else self._reference(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]; float32 matmul of the dequantised operands
        xq, sx = quantize_rows(x)
        w = dequantize_rows(self.weight_fp8, self.weight_scale[:, None])  # [N, K]
        y = dequantize_rows(xq, sx) @ w.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]; operands as the row-wise recipe wants them (module docstring)
        kp = self.weight_fp8.shape[1]
        if kp != self.in_features:
            x = F.pad(x, (0, kp - self.in_features))
        xq, sx = quantize_rows(x)  # [M, Kp] row-major, [M, 1]
        out = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        bias = None
        if self.bias is not None and out != torch.float32:  # fused: [Np] of the output's dtype
            bias = F.pad(self.bias.to(out), (0, self.weight_fp8.shape[0] - self.out_features))
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=sx,
                             scale_b=self.weight_scale[None, :], bias=bias,
                             out_dtype=out)  # [M, Np]
        y = y[:, : self.out_features]
        if self.bias is not None and bias is None:
            y = y + self.bias.to(out)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.backend}")


def convert_linears_fp8(module: nn.Module, include: Iterable[str] = ("*",),
                        exclude: Iterable[str] = ("*lm_head",),
                        backend: str | None = None) -> list[str]:
    """Swap ``module``'s ``nn.Linear`` children (at any depth) whose qualified names match a
    pattern of ``include`` and none of ``exclude`` (``fnmatch``: ``"layers.*.mlp.*"``) for
    ``Fp8Linear``, in place; returns the names swapped. The LM head is left out by default:
    it is tied to the embeddings in small Qwen2 models and runs on one row per question.
    ``backend`` None: ``require_fp8`` of each weight's device."""
    inc, exc = tuple(include), tuple(exclude)
    swapped = []
    for name, lin in list(module.named_modules()):
        if not isinstance(lin, nn.Linear):
            continue
        if not any(fnmatch.fnmatchcase(name, p) for p in inc) or any(
                fnmatch.fnmatchcase(name, p) for p in exc):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.from_linear(lin, backend))
        swapped.append(name)
    return swapped
