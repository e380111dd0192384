"""Attention over contiguous segments of a packed sequence (one image, or one Qwen2.5-VL
window) as one padded SDPA batch: the Qwen-VL towers' attention that never crosses an
image. ``BlockMask`` is the static-shape form of the same attention (one boolean mask over
the whole packed sequence), for CUDA graphs captured at a fixed token budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


@dataclass(frozen=True)
class BlockMask:
    """``mask`` [1, 1, N, N] bool: token i may attend token j (same segment). Equal to
    ``Segments`` for the same segments, at N x N memory, with no data-dependent shape: what a
    CUDA graph of a fixed N can capture (``vision_static.py``)."""

    mask: torch.Tensor


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seg: Segments | BlockMask) -> torch.Tensor:
    """Non-causal attention inside each segment. q, k, v: [N, H, d] -> [N, H, d]."""
    if isinstance(seg, BlockMask):
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, N, d]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask)[0].transpose(0, 1)
    n, h, d = q.shape
    s, L = seg.index.shape
    if seg.mask is None:  # equal segments: a view, no gather
        q, k, v = (t.view(s, L, h, d).transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = (t[seg.index].transpose(1, 2) for t in (q, k, v))  # [S, H, L, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask).transpose(1, 2)
    return out.reshape(n, h, d) if seg.mask is None else out[seg.valid]
