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

from collections.abc import Callable

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
    model's dtype, as Qwen2's RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None
                        ) -> torch.Tensor:
    """``1 / theta^(2i / dim)`` for i < dim/2, float32 ``[dim/2]``."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


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
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


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
