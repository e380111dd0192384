"""Layers shared by the model families: RMSNorm (two forms, and Qwen3.5's zero-centred one),
rotary position embedding, and activations by their config names. Each matches
transformers' definition of the same layer (tested through the families' reference checks).

Rotary convention (InternVL's Qwen2 decoder and every Qwen-VL tower and decoder):
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. The sign is folded
into the table once: with ``sin_t = cat(-s, s)``, ``rotate_half(x) * cat(s, s) ==
roll(x, d/2) * sin_t`` exactly, and a roll is one kernel where the negation and
concatenation were two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "silu": F.silu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # Qwen2-VL's vision MLP
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names (``hidden_act``); ValueError listing the known ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, statistics in float32, written out op by op (the form that
    exports to every ONNX opset and that InternViT's ``rms_norm`` layers use)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class FusedRMSNorm(RMSNorm):
    """The same maths through torch's ``rms_norm``: one op where the written-out form
    dispatches six (the decoder's hot path; float32 statistics, weight applied in the
    model's dtype, as Qwen2's RMSNorm). In float32 the weight goes into the same op (no
    casts to make; bitwise the same: tests/models/test_fusion.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class CenteredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm: the weight is stored as an offset from 1 (transformers initialises
    it to 0), ``(1 + weight) * x / rms(x)``, all in float32, then cast to the input dtype
    (transformers' ``Qwen3_5RMSNorm``: ``(x * w).to(dtype)``, unlike Qwen2's
    ``w * x.to(dtype)``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return y.to(x.dtype)


def cat_linears(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear computing ``parts`` side by side (their outputs concatenated, in order):
    plain ``nn.Linear`` weights and biases concatenated once (each output the same dot
    product as before); a quantised kind (``quant/``) through its own ``cat`` classmethod,
    where it has one that is exact (row-wise scales). None when the parts cannot be
    joined (mixed kinds, torch's dynamic int8 linears whose one scale per tensor differs)."""
    if not joinable(parts):
        return None
    kind = type(parts[0])
    if kind is nn.Linear:
        linears = [cast(nn.Linear, p) for p in parts]
        w = linears[0].weight
        out = nn.Linear(w.shape[1], sum([p.out_features for p in linears]),
                        bias=linears[0].bias is not None, device="meta")
        with torch.no_grad():
            out.weight = nn.Parameter(torch.cat([p.weight for p in linears]), w.requires_grad)
            if linears[0].bias is not None:
                out.bias = nn.Parameter(torch.cat([cast(torch.Tensor, p.bias) for p in linears]),
                                        w.requires_grad)
        return out
    cat = getattr(kind, "cat", None)
    return cat(parts) if cat is not None else None


def joinable(parts: Sequence[nn.Module]) -> bool:
    """Whether ``cat_linears`` can join ``parts``: one kind, plain linears (all with a bias
    or none) or a kind with a ``cat``."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return False
    if kind is not nn.Linear:
        return callable(getattr(kind, "cat", None))
    return len({p.bias is None for p in parts}) == 1


def fuse_into(module: nn.Module, name: str, parts: tuple[str, ...], apply: bool = True) -> bool:
    """Replace ``module``'s linears ``parts`` by one (``cat_linears``) named ``name``;
    ``module.fused`` becomes True and ``module.fusions[name]`` records each part's name and
    rows (what ``quant.runtime`` maps a checkpoint's per-part tensors by, and ``unfuse``
    undoes). False (nothing changed) if already fused or if the parts cannot be joined.
    ``apply`` False: only whether it would fuse."""
    if getattr(module, "fused", False):
        return False
    linears = [getattr(module, p) for p in parts]
    if not apply:
        return joinable(linears)
    joined = cat_linears(linears)
    if joined is None:
        return False
    for p in parts:
        delattr(module, p)
    setattr(module, name, joined)
    setattr(module, "fused", True)  # noqa: B010  (a plain attribute of any module)
    setattr(module, "fusions", {**getattr(module, "fusions", {}),  # noqa: B010
                                name: tuple((p, lin.out_features)
                                            for p, lin in zip(parts, linears))})
    return True


def unfuse(module: nn.Module, name: str) -> None:
    """``fuse_into``'s inverse for a plain fused ``nn.Linear``: the parts back, each its rows
    of the fused weight and bias (a copy)."""
    joined = getattr(module, name)
    fusions: dict[str, tuple[tuple[str, int], ...]] = getattr(module, "fusions")  # noqa: B009
    parts = fusions.pop(name)
    at = 0
    for part, rows in parts:
        lin = nn.Linear(joined.in_features, rows, bias=joined.bias is not None, device="meta")
        with torch.no_grad():
            lin.weight = nn.Parameter(joined.weight[at: at + rows].clone())
            if joined.bias is not None:
                lin.bias = nn.Parameter(joined.bias[at: at + rows].clone())
        setattr(module, part, lin)
        at += rows
    delattr(module, name)
    setattr(module, "fused", bool(fusions))  # noqa: B010


def fuse_projections(root: nn.Module, apply: bool = True) -> int:
    """Fuse every submodule of ``root`` that can (``fuse_projections()`` methods: the
    decoder's q/k/v and gate/up, the vision towers' likewise): done once, at load, so a
    layer runs one GEMM per input where it ran two or three. Returns how many fused.
    Idempotent; parameter names and ``state_dict`` keys change (``qkv_proj``,
    ``gate_up_proj``), which is why it runs after loading and quantising a checkpoint's
    linears by name and never before calibration. ``apply`` False: how many would fuse,
    nothing changed."""
    fusers = [f for m in list(root.modules())
              if callable(f := getattr(m, "fuse_projections", None))]
    return sum([bool(f(apply)) for f in fusers])


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None
                        ) -> torch.Tensor:
    """``1 / theta^(2i / dim)`` for i < dim/2, float32 ``[dim/2]``: made once per device
    (``_frequencies``) and shared, so never change it in place."""
    return _frequencies(dim, theta, device if device is not None else _CPU)


_CPU = torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _frequencies(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The table, computed on ``device`` (the same numbers as computing it there per call;
    four ops fewer per forward); a normal tensor, usable outside inference mode."""
    with torch.inference_mode(False):
        return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device)
                               / dim)


def scaled_inverse_frequencies(dim: int, theta: float, scaling: str, factor: float,
                               max_positions: int, seq_lens: torch.Tensor | None,
                               device: torch.device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[B or 1, dim/2]`` float32, what positions are divided by) of
    InternLM2's and transformers' Llama rotary scalings: ``linear`` divides positions by
    ``factor``; ``dynamic`` (NTK) gives a row of length L > max_positions the base ``theta *
    (factor L / max_positions - (factor - 1)) ** (dim / (dim - 2))``, computed in float64
    and rounded to float32 as the published Python float is; seq_lens [B]: each L."""
    if scaling == "linear":
        return inverse_frequencies(dim, theta, device)[None], factor
    assert scaling == "dynamic" and seq_lens is not None
    n = seq_lens.double()
    grown = (factor * n / max_positions - (factor - 1)) ** (dim / (dim - 2))
    base = torch.where(n > max_positions, theta * grown, torch.full_like(n, theta)).float()
    exps = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / base[:, None] ** exps, 1.0


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles ``[..., d/2]`` (float32) -> ``(cos, sin)`` each ``[..., d]`` in ``dtype``, the sign
    of ``rotate_half`` folded into ``sin`` (module docstring)."""
    cos, sin = freqs.cos(), freqs.sin()
    cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def rotary(positions: torch.Tensor, head_dim: int, theta: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D positions [B, T] -> (cos, sin) each [B, 1, T, d] in ``dtype``, computed in float32,
    for ``rope`` (the Qwen2 decoder's table)."""
    inv_freq = inverse_frequencies(head_dim, theta, positions.device)
    cos, sin = rope_tables(positions.float()[..., None] * inv_freq, dtype)  # [B, T, d]
    return cos[:, None], sin[:, None]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [..., d]`` with (cos, sin) from ``rope_tables``, broadcast."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
