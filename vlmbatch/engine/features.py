"""Vision features of a clip's frame groups, cached by content across calls.

A frame group is what the vision tower encodes alone (``preprocessing/media.py``): Qwen-VL's
temporal patch of 2 frames (its blocks attend inside one temporal patch: transformers'
``cu_seqlens`` are per ``t``, and Qwen2.5-VL's windows per ``t``, so a clip's tokens equal
its groups' encoded one by one), InternVL's one frame (a 448 px tile, tiles independent).
So a group's features are exact to reuse: overlapping windows of one clip and repeated
items encode each group once. Keyed by the group's hash and layout (``group_key``); LRU
within a byte budget; ``encoded`` and ``hits`` count groups.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from vlmbatch.preprocessing.media import PreparedVideo
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid
from vlmbatch.preprocessing.tiling import TileGrid

Features = tuple[torch.Tensor, tuple[torch.Tensor, ...]]  # embeds [n, D], DeepStack layers


def group_key(video: PreparedVideo, index: int) -> str:
    """Identifies group ``index``'s tokens: its pixels' hash and the clip's layout."""
    return f"group:{video.group_hashes[index]}:{video.grid.key}@{video.rows.shape[1:]}"


def group_image(video: PreparedVideo, index: int) -> PreparedImage:
    """Group ``index`` of a clip as the still image the vision module encodes alone: Qwen-VL
    patch rows (2-D) of one temporal patch with grid ``(1, h, w)``; InternVL one frame tile."""
    if video.rows.ndim == 2:
        _, h, w = video.grid.dims
        merge = getattr(video.grid, "merge", 2)
        rows = video.rows[index * h * w: (index + 1) * h * w]
        return PreparedImage(rows, PatchGrid(1, h, w, merge), video.group_hashes[index],
                             video.width, video.height)
    return PreparedImage(video.rows[index: index + 1], TileGrid(1, 1, False),
                         video.group_hashes[index], video.width, video.height)


class FeatureCache:
    def __init__(self, budget_bytes: int = 256 << 20) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[str, Features] = OrderedDict()
        self._bytes = 0
        self.encoded = 0  # groups through the vision tower
        self.hits = 0  # groups served from the cache

    def get(self, key: str) -> Features | None:
        got = self._items.get(key)
        if got is not None:
            self._items.move_to_end(key)
            self.hits += 1
        return got

    def put(self, key: str, features: Features) -> None:
        size = sum(t.numel() * t.element_size() for t in (features[0], *features[1]))
        if key in self._items or size > self.budget:
            return
        self._items[key] = features
        self._bytes += size
        while self._bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in (old[0], *old[1]))
