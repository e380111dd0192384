"""The Qwen-VL towers at a fixed token budget: static shapes for CUDA graphs.

A CUDA graph replays fixed shapes, but the towers' index maths depends on every image's grid
(rotary tables, which tokens attend which, Qwen2.5-VL's window order, Qwen3-VL's resampled
position table). As vLLM does for its encoder graphs, images are packed into a budget of B
patch rows (``cudagraph_pool.BudgetPool``): the real rows first, then padding. ``budget_meta``
makes the call's index maths on the host, as tensors of shapes fixed by B alone;
``budget_forward`` runs the tower on the padded rows with them, with no host work inside (a
CPU test checks it with ``cudagraph_pool.capture_hazards``), so it can be captured once per
budget and replayed with new rows and meta copied into its static inputs.

Padding: rows of zeros, one segment of their own for attention (so no query sees only masked
keys), rotary tables and positions zero, units after the real ones in the window order. The
first ``n / merge**2`` output tokens are the images' (tested equal to ``VisionTower.forward``).
Attention becomes one ``[B, B]`` boolean mask (``segments.BlockMask``): B x B memory where the
eager path pads per image, the price of a static shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vlmbatch.models.qwen_vl.segments import BlockMask
from vlmbatch.models.qwen_vl.vision import TowerLayout, VisionTower, by_unit
from vlmbatch.models.qwen_vl.vision_grid import (
    Grid,
    as_grids,
    frame_lengths,
    interpolate_positions,
    window_order,
)


def _same_segment(lengths: Sequence[int], budget: int, dev: torch.device) -> torch.Tensor:
    """[1, 1, B, B] bool: rows in the same segment (the padding rows one more segment)."""
    ids = torch.repeat_interleave(torch.arange(len(lengths) + 1),
                                  torch.tensor([*lengths, budget - sum(lengths)]))
    ids = ids.to(dev)
    return (ids[:, None] == ids[None, :])[None, None]


def budget_meta(tower: VisionTower, dims: Sequence[tuple[int, ...]], budget: int,
                dev: torch.device) -> dict[str, torch.Tensor]:
    """The index maths of ``dims`` (each image's (t, h, w); may be empty) padded to
    ``budget`` rows, as tensors whose shapes depend on ``budget`` only."""
    s = tower.spec
    grids = as_grids(dims, s.merge) if dims else []
    n, unit = sum(t * h * w for t, h, w in grids), s.merge * s.merge
    if n > budget or budget % unit:
        raise ValueError(f"{n} rows do not fit a budget of {budget} (a multiple of {unit})")
    pad = budget - n
    cos, sin = tower.rotary(grids, dev) if grids else (torch.zeros(0, 1, s.head_dim,
                                                                   device=dev),) * 2
    cos, sin = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (cos, sin))  # [B, 1, d]
    meta = {"full": _same_segment(frame_lengths(grids), budget, dev)}
    if tower.pos_embed is not None:
        meta["pos"] = F.pad(positions(tower, grids), (0, 0, 0, pad))
    if s.window:
        perm, lengths = window_order(grids, s.merge, s.window // s.merge // s.patch) \
            if grids else (torch.zeros(0, dtype=torch.long), [])
        perm = torch.cat([perm, torch.arange(n // unit, budget // unit)]).to(dev)
        cos, sin = (by_unit(t, perm, s.merge) for t in (cos, sin))
        meta.update(window=_same_segment(lengths, budget, dev), perm=perm,
                    back=torch.argsort(perm))
    meta.update(cos=cos, sin=sin)
    return meta


def positions(tower: VisionTower, grids: list[Grid]) -> torch.Tensor:
    """Qwen3-VL's resampled position table for ``grids`` ([n, C]; [0, C] for none)."""
    assert tower.pos_embed is not None
    table = tower.pos_embed.weight
    if not grids:
        return table.new_zeros(0, table.shape[1])
    return interpolate_positions(table, grids, tower.spec.merge)


def budget_forward(tower: VisionTower, rows: torch.Tensor,
                   meta: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``rows`` [B, C*T*P*P] uint8 (real rows first, then padding) with ``budget_meta``'s
    tensors -> (embeds [B / merge**2, D_text], *deepstack): the real images' tokens first."""
    full = BlockMask(meta["full"])
    lay = TowerLayout(meta["cos"], meta["sin"], full,
                      BlockMask(meta["window"]) if "window" in meta else full,
                      meta.get("perm"), meta.get("back"), meta.get("pos"))
    out = tower.run(rows, lay)
    return (out.embeds, *out.deepstack)
