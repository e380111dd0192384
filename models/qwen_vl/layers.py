"""Small layers the Qwen-VL towers and decoders share: RMSNorm, activations, rotary, and
attention over contiguous segments of a packed sequence (one image, or one window).

Rotary convention (all of this family): ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``. We fold the sign into the table once: with
``sin_t = cat(-s, s)``, ``rotate_half(x) * cat(s, s) == roll(x, d/2) * sin_t`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The checkpoint's ``hidden_act`` as a function."""
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(table)}")
    return table[name]


class RMSNorm(nn.Module):
    """Statistics in float32, weight applied in the input's dtype (as Qwen's RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles ``[..., d/2]`` (float32) -> ``(cos, sin)`` each ``[..., d]`` in ``dtype``, the sign
    of ``rotate_half`` folded into ``sin`` (module docstring)."""
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [..., d]`` with ``rope_tables``' (cos, sin), broadcast."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None
                        ) -> torch.Tensor:
    """``1 / theta^(2i / dim)`` for i < dim/2, float32 ``[dim/2]``."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


@dataclass(frozen=True)
class Segments:
    """A packed sequence of N tokens cut into S contiguous segments, as a padded batch.

    ``index`` [S, L] long: token of each slot (L = longest segment; padding slots point at
    token 0); ``valid`` [S, L] bool; ``mask`` [S, 1, 1, L] bool (keys a query may attend), or
    None when every segment has length L (no padding). Attention inside segments is then one
    SDPA call, equal to a block-diagonal mask over the N tokens without its N x N memory.
    """

    index: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor | None

    @staticmethod
    def of(lengths: Sequence[int], device: torch.device) -> Segments:
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"segment lengths must be positive, got {list(lengths)}")
        lens = torch.tensor(list(lengths), device=device)
        longest = int(lens.max())
        starts = torch.cumsum(lens, 0) - lens
        slot = torch.arange(longest, device=device)
        valid = slot[None, :] < lens[:, None]
        index = torch.where(valid, starts[:, None] + slot[None, :], 0)
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        return Segments(index, valid, mask)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seg: Segments) -> torch.Tensor:
    """Non-causal attention inside each segment. q, k, v: [N, H, d] -> [N, H, d]."""
    n, h, d = q.shape
    s, L = seg.index.shape
    if seg.mask is None:  # equal segments: a view, no gather
        q, k, v = (t.view(s, L, h, d).transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = (t[seg.index].transpose(1, 2) for t in (q, k, v))  # [S, H, L, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask).transpose(1, 2)
    return out.reshape(n, h, d) if seg.mask is None else out[seg.valid]
