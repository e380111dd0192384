"""Index maths of the Qwen-VL vision towers over a batch of image grids (small ints, no weights).

Token order everywhere is the preprocessing's patch order (``preprocessing/qwen_vl.py``):
images one after another; inside an image, frames, then merge windows row-major, then the
``m x m`` patches of a merge window row-major. A *unit* is one merge window (m*m consecutive
tokens, one LLM token after the merger).

``grid_thw`` is a sequence of (t, h, w) in patches, h and w multiples of the merge size m.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]


def as_grids(grid_thw: Sequence[Sequence[int]] | torch.Tensor, merge: int) -> list[Grid]:
    """``grid_thw`` (a sequence of triples or an [n, 3] tensor) as checked Python triples."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    grids = []
    for g in rows:
        t, h, w = (int(x) for x in g)
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise ValueError(f"grid (t, h, w) = {(t, h, w)}: need positive sides, h and w "
                             f"multiples of the merge size {merge}")
        grids.append((t, h, w))
    return grids


def patch_coords(grids: Sequence[Grid], merge: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) in patches of every token, each [N] long, N = sum t*h*w."""
    rows, cols = [], []
    for t, h, w in grids:
        i = torch.arange(h * w, device=device)
        unit, inner = i // (merge * merge), i % (merge * merge)
        r = (unit // (w // merge)) * merge + inner // merge
        c = (unit % (w // merge)) * merge + inner % merge
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
    return torch.cat(rows), torch.cat(cols)


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """Tokens of each frame: the segments full attention stays inside."""
    return [h * w for t, h, w in grids for _ in range(t)]


def window_order(grids: Sequence[Grid], merge: int,
                 side: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window layout: units regrouped so that each window of ``side x side``
    units (fewer at the right and bottom edges) is contiguous.

    Returns ``perm`` [U] long (new unit order: windows in frame-then-raster order, units
    row-major inside a window; a stable sort by window id) and the windows' lengths in tokens.
    """
    ids, offset = [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // side), -(-gw // side)
        r = torch.arange(gh).repeat_interleave(gw)
        c = torch.arange(gw).repeat(gh)
        per_frame = (r // side) * nw + c // side  # [gh*gw]
        frames = torch.arange(t).repeat_interleave(gh * gw) * (nh * nw)
        ids.append(offset + frames + per_frame.repeat(t))
        offset += t * nh * nw
    window = torch.cat(ids)
    perm = torch.argsort(window, stable=True)
    counts = torch.bincount(window)
    return perm, [int(n) * merge * merge for n in counts.tolist() if n]


def interpolate_positions(table: torch.Tensor, grids: Sequence[Grid],
                          merge: int) -> torch.Tensor:
    """Qwen3-VL: learned position table ``[side*side, C]`` resampled to each grid
    (bilinear, corners aligned), in token order -> ``[N, C]``."""
    side = int(round(table.shape[0] ** 0.5))
    square = table.view(side, side, -1).permute(2, 0, 1)[None].float()  # [1, C, side, side]
    out = []
    for t, h, w in grids:
        g = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]
        g = g.view(-1, h // merge, merge, w // merge, merge)  # [C, uy, my, ux, mx]
        g = g.permute(1, 3, 2, 4, 0).reshape(h * w, -1)  # token order
        out.append(g.repeat(t, 1))
    return torch.cat(out).to(table.dtype)
