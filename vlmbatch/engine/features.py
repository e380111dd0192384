"""Vision features of an item's parts (``MediaItem``): a clip's frame groups cached by
content across calls, and the item's embeddings over its whole prompt span.

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
from collections.abc import Callable

import torch

from vlmbatch.engine.records import MediaItem
from vlmbatch.models.base import LoadedModel
from vlmbatch.preprocessing.media import MediaPart, PreparedVideo
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import PatchGrid
from vlmbatch.preprocessing.tiling import TileGrid

Features = tuple[torch.Tensor, tuple[torch.Tensor, ...]]  # embeds [n, D], DeepStack layers


def group_key(video: PreparedVideo, index: int) -> str:
    """Identifies group ``index``'s tokens: its pixels' hash and one group's layout (Qwen-VL:
    its patch grid ``h x w``; InternVL: the tile), not the clip's length, so that windows of
    one clip sampled to different lengths share the groups they have in common."""
    return f"group:{video.group_hashes[index]}:{video.grid.dims[1:]}@{video.rows.shape[1:]}"


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
        self.hits = 0  # groups found cached when an item needed them

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> Features | None:
        got = self._items.get(key)
        if got is not None:
            self._items.move_to_end(key)
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


Encode = Callable[[list[PreparedImage]], list[Features]]  # still images -> features, in order


def span_embeddings(item: MediaItem, model: LoadedModel, encode: Encode, cache: FeatureCache,
                    device: torch.device) -> Features:
    """An item's embeddings over its whole span (``Prompt.parts``: its first visual token
    through its last): each part's features at its runs, the text between runs (markers,
    times, frame labels: the same for every question) as its token embeddings, so the engine
    writes the span as it writes one image's; DeepStack rows are 0 at the text (the decoder
    adds them: x + 0 is x)."""
    prompt = model.prompts.build_parts("", item.parts)
    lo, n = prompt.image_start, prompt.image_len
    feats = [part_features(p, encode, cache) for p in item.parts]
    dest = torch.tensor([s - lo + i for runs in prompt.parts for s, m in runs
                         for i in range(m)], device=device)
    x = model.llm.embed_tokens(torch.tensor(prompt.ids[lo: lo + n], device=device)).clone()
    x[dest] = torch.cat([e for e, _ in feats]).to(x.dtype)
    deep = []
    for layer in zip(*[d for _, d in feats]):
        full = torch.zeros_like(x)
        full[dest] = torch.cat(layer).to(x.dtype)
        deep.append(full)
    return x, tuple(deep)


def part_features(part: MediaPart, encode: Encode, cache: FeatureCache) -> Features:
    """An image's features, or a clip's: its groups in order, only those not cached
    encoded (one call for all of them)."""
    if isinstance(part, PreparedImage):
        return encode([part])[0]
    keys = [group_key(part, g) for g in range(len(part.group_hashes))]
    need = {k: g for g, k in enumerate(keys) if k not in cache}
    for key, f in zip(need, encode([group_image(part, g) for g in need.values()])):
        cache.put(key, f)
    cache.encoded += len(need)
    cache.hits += len(keys) - len(need)
    got = []
    for g, key in enumerate(keys):
        found = cache.get(key)
        if found is None:  # over the cache's budget: encoded again
            found = encode([group_image(part, g)])[0]
            cache.encoded += 1
        got.append(found)
    return (torch.cat([e for e, _ in got]),
            tuple(torch.cat(layer) for layer in zip(*[d for _, d in got])))
