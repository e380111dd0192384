"""Image-aware prefix KV cache: full blocks of prompt KV keyed by content, LRU under a byte budget.

A prompt's token ids are cut into blocks of ``block_size``. The engine caches the full blocks
of a prompt's shared prefix and the partial block that ends it (at ``</img>``). The key of
block i is a hash chain::

    key_i = xxh3_128(key_{i-1} || token ids of block i || extra keys of block i)

where the extra keys are ``(image content hash, offset of the block start inside the image
span)`` for every image span the block overlaps. Two different images behind identical
``<IMG_CONTEXT>`` ids therefore never share a key (the 58.com bug), and the same pixels under
the same tiling always do. Because the chain runs from the first token, a hit on block i means
blocks 0..i-1 match too.

On a hit, the stored token ids and extra keys are compared with the request's (a hash
collision must never return wrong KV). Each entry holds the block's KV for all layers,
``[layers, 2, kv_heads, block_size, head_dim]``; ``bytes`` counts their storage and the least
recently used entries are evicted while it exceeds ``budget_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import torch
import xxhash

BlockKey = NewType("BlockKey", bytes)


@dataclass(frozen=True)
class ImageSpan:
    start: int  # index of the first image token in the prompt
    length: int
    content_hash: str  # PreparedImage.content_hash (pixels + shape) + tiling


@dataclass(frozen=True)
class BlockId:
    key: BlockKey
    parent: bytes  # key of the previous block (b"" for the first)
    ids: tuple[int, ...]
    extra: tuple[tuple[str, int], ...]


@dataclass
class CacheStats:
    hits: int = 0  # blocks found
    misses: int = 0  # blocks looked up and not found (the first miss ends a lookup)
    inserts: int = 0
    evictions: int = 0
    collisions: int = 0  # key matched but ids/extras did not

    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


def block_ids(ids: Sequence[int], images: Sequence[ImageSpan], block_size: int,
              limit: int | None = None, tail: bool = False) -> list[BlockId]:
    """Keys of the full blocks of ``ids[:limit]``; with ``tail``, also of the partial block
    that ends at ``limit`` (the end of a prompt's shared prefix)."""
    end = len(ids) if limit is None else min(limit, len(ids))
    out: list[BlockId] = []
    parent = b""
    for start in range(0, end, block_size):
        stop = start + block_size
        if stop > end:
            if not tail:
                break
            stop = end
        toks = tuple(ids[start:stop])
        extra = tuple((im.content_hash, start - im.start) for im in images
                      if im.start < stop and start < im.start + im.length)
        h = xxhash.xxh3_128(parent)
        h.update(np.asarray(toks, dtype=np.int64).tobytes())
        h.update(repr(extra).encode())
        out.append(BlockId(BlockKey(h.digest()), parent, toks, extra))
        parent = h.digest()
    return out


@dataclass
class _Entry:
    block: BlockId
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim], tokens == len(block.ids)


class PrefixCache:
    def __init__(self, block_size: int = 16, budget_bytes: int = 1 << 30) -> None:
        if block_size < 1 or budget_bytes < 0:
            raise ValueError("block_size must be >= 1 and budget_bytes >= 0")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every block (counters kept); e.g. between benchmark rounds."""
        self._entries.clear()
        self.bytes = 0

    def lookup(self, blocks: Sequence[BlockId]) -> list[torch.Tensor]:
        """KV of the longest cached prefix of ``blocks`` (marks them recently used)."""
        found: list[torch.Tensor] = []
        for b in blocks:
            e = self._entries.get(b.key)
            if e is not None and (e.block.ids, e.block.extra, e.block.parent) != (
                    b.ids, b.extra, b.parent):
                self.stats.collisions += 1
                e = None
            if e is None:
                self.stats.misses += 1
                break
            self.stats.hits += 1
            found.append(e.kv)
        self.touch([b.key for b in blocks[: len(found)]])
        return found

    def touch(self, chain: Sequence[BlockKey]) -> None:
        """Mark a chain recently used, its first block most recently: eviction then takes a
        chain's tail before its head, so what stays cached is always a usable prefix."""
        for key in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def insert(self, block: BlockId, kv: torch.Tensor) -> None:
        """Store one block's KV ``[layers, 2, kv_heads, block_size, head_dim]``."""
        if block.key in self._entries:
            self._entries.move_to_end(block.key)
            return
        size = kv.numel() * kv.element_size()
        if size > self.budget_bytes:
            return
        self._entries[block.key] = _Entry(block, kv)
        self.bytes += size
        self.stats.inserts += 1
        while self.bytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.kv.numel() * old.kv.element_size()
            self.stats.evictions += 1
