"""Image-aware prefix KV cache: blocks of prompt KV keyed by content, in a fixed pool, LRU.

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
collision must never return wrong KV).

Storage is one allocation of ``budget_bytes`` at most, cut into ``slots`` of one full block's
KV each, made by ``allocate`` (the engine calls it when built; else the first insert does);
``pool`` views it as ``[slots, layers, 2, kv_heads, block_size, head_dim]``, ``arena`` as
bytes ``[slots, slot_bytes]``. A block entry owns one slot (a partial block uses its first
tokens). One allocation instead of one per block: cached and freed blocks no longer
interleave with the engine's temporaries in the allocator, which on CPU held the process ~2x
the budget above it (glibc's heap cannot shrink around them; ``docs/engine.md``). When no
slot is free the least recently used *unpinned* entry is evicted. ``lookup`` returns views
into the pool and pins what it found: a pinned slot is not reused until ``unpin``, so KV
handed to a plan stays valid while later batches insert.

State snapshots (Qwen3.5's linear-attention layers, ``docs/hybrid_cache.md``): a state entry
holds the bytes of every linear layer's state at the end of a shared prefix, in as many
slots as they need (``state_slots``, not necessarily adjacent), keyed by ``state_key`` of the
prefix's last block, so by the same content hash as the blocks. Blocks and snapshots share
the slots, the budget and the LRU order; a snapshot is looked up, pinned and evicted whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, NewType

import numpy as np
import torch
import xxhash

BlockKey = NewType("BlockKey", bytes)


@dataclass(frozen=True)
class ImageSpan:
    start: int  # index of the first image token in the prompt
    length: int
    content_hash: str  # PreparedImage.content_hash (pixels + shape) + tiling


class BlockId(NamedTuple):
    """One block of a prompt: its chained key, its parent's key (b"" for the first), its
    token ids and its extra keys ((image content hash, offset of the block's start in the
    image span), per image it overlaps). A named tuple: a prompt's prefix makes one per
    block, and a tuple is built without a call per field."""
    key: BlockKey
    parent: bytes
    ids: tuple[int, ...]
    extra: tuple[tuple[str, int], ...]


@dataclass
class PrefixCacheStats:
    hits: int = 0  # blocks found
    misses: int = 0  # blocks looked up and not found (the first miss ends a lookup)
    inserts: int = 0
    evictions: int = 0
    collisions: int = 0  # key matched but ids/extras did not
    state_hits: int = 0  # state snapshots found (each one whole prefix's)
    state_misses: int = 0
    state_inserts: int = 0

    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


def block_ids(ids: Sequence[int], images: Sequence[ImageSpan], block_size: int,
              limit: int | None = None, tail: bool = False,
              head: Sequence[BlockId] = ()) -> list[BlockId]:
    """Keys of the full blocks of ``ids[:limit]``; with ``tail``, also of the partial block
    that ends at ``limit`` (the end of a prompt's shared prefix). ``head``: the chain's
    first blocks already made (from a longer limit over the same ids, each full), reused.
    A block's key is the xxh3-128 of its parent's key, its token ids (int64 bytes) and
    its extra keys (module docstring); the bytes of all the ids are made once."""
    ids = tuple(ids)
    end = len(ids) if limit is None else min(limit, len(ids))
    out = list(head)
    parent = out[-1].key if out else b""
    data = np.asarray(ids[:end], dtype=np.int64).tobytes()
    spans = [(im.start, im.start + im.length, im.content_hash, im.content_hash.encode())
             for im in images]
    new = tuple.__new__  # a named tuple without its Python-level __new__: one call a block
    for start in range(len(out) * block_size, end, block_size):
        stop = start + block_size
        if stop > end:
            if not tail:
                break
            stop = end
        extra: tuple[tuple[str, int], ...] = ()
        mark = b""
        for first, last, name, raw in spans:
            if first < stop and start < last:
                extra += ((name, start - first),)
                mark += b"%s@%d;" % (raw, start - first)
        key = BlockKey(xxhash.xxh3_128_digest(parent + data[8 * start: 8 * stop] + mark))
        out.append(new(BlockId, (key, parent, ids[start:stop], extra)))
        parent = key
    return out


def state_key(tail: BlockId) -> BlockKey:
    """The key of the state snapshot at the end of the prefix whose last block is ``tail``:
    derived from the block's chained key, so from every token and image before it."""
    return BlockKey(xxhash.xxh3_128(b"linear-state\0" + tail.key).digest())


@dataclass
class _Entry:
    block: BlockId  # a state snapshot: the last block of its prefix (checked on a hit)
    slots: list[int]  # a block's KV: pool[slots[0], :, :, :, :len(block.ids)]
    pins: int = 0  # lookups not yet unpinned: the slots must not be reused


class PrefixCache:
    def __init__(self, block_size: int = 16, budget_bytes: int = 1 << 30) -> None:
        if block_size < 1 or budget_bytes < 0:
            raise ValueError("block_size must be >= 1 and budget_bytes >= 0")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._pool: torch.Tensor | None = None  # [slots, L, 2, K, block_size, d]
        self._arena: torch.Tensor | None = None  # the same memory, [slots, slot_bytes] uint8
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (a full block's KV); 0 before the first insert."""
        if self._pool is None:
            return 0
        return self._pool.shape[1:].numel() * self._pool.element_size()

    @property
    def bytes(self) -> int:
        """Bytes of the slots in use (the pool itself is ``budget_bytes`` at most)."""
        return sum(len(e.slots) for e in self._entries.values()) * self.slot_bytes

    def state_slots(self, nbytes: int) -> int:
        """Slots a state snapshot of ``nbytes`` bytes takes (0 before the pool exists)."""
        return -(-nbytes // self.slot_bytes) if self.slot_bytes else 0

    def clear(self) -> None:
        """Drop every block (counters and the pool kept); e.g. between benchmark rounds, never
        while a lookup's blocks are still pinned."""
        self._entries.clear()
        if self._pool is not None:
            self._free = list(range(len(self._pool) - 1, -1, -1))

    def lookup(self, blocks: Sequence[BlockId]) -> list[torch.Tensor]:
        """KV ``[L, 2, K, n, d]`` of the longest cached prefix of ``blocks``: views into the
        pool, pinned (``unpin`` them once read) and marked recently used."""
        pool = self._pool
        return [pool[slot, :, :, :, : len(b.ids)]  # type: ignore[index]
                for slot, b in zip(self.lookup_slots(blocks), blocks)]

    def lookup_slots(self, blocks: Sequence[BlockId]) -> list[int]:
        """As ``lookup``, but the pool slots of the longest cached prefix of ``blocks``
        (pinned; read them through ``pool``). Only a chain's last block may be partial, so
        the prefix's tokens are the slots' first ``sum(len(b.ids))`` positions in order."""
        found: list[int] = []
        for b in blocks:
            e = self._checked(b.key, b)
            if e is None:
                self.stats.misses += 1
                break
            self.stats.hits += 1
            e.pins += 1
            found.append(e.slots[0])
        self.touch([b.key for b in blocks[: len(found)]])
        return found

    def lookup_state(self, tail: BlockId) -> list[int]:
        """The slots of the state snapshot at the end of the prefix ending with ``tail``
        (pinned, marked recently used; read them through ``arena``), or [] if none."""
        key = state_key(tail)
        e = self._checked(key, tail)
        if e is None:
            self.stats.state_misses += 1
            return []
        self.stats.state_hits += 1
        e.pins += 1
        self._entries.move_to_end(key)
        return list(e.slots)

    def _checked(self, key: BlockKey, block: BlockId) -> _Entry | None:
        """The entry under ``key`` if it was made for ``block`` (same ids, extras, parent)."""
        e = self._entries.get(key)
        if e is not None and (e.block.ids, e.block.extra, e.block.parent) != (
                block.ids, block.extra, block.parent):
            self.stats.collisions += 1
            return None
        return e

    @property
    def arena(self) -> torch.Tensor:
        """The pool's memory as bytes, ``[slots, slot_bytes]`` uint8 (state snapshots)."""
        if self._arena is None:
            raise RuntimeError("the prefix cache's pool is not allocated yet")
        return self._arena

    @property
    def pool(self) -> torch.Tensor:
        """The KV pool ``[slots, L, 2, K, block_size, d]``. Every position of a slot in use
        is finite: a partial block's unused tail is zeroed when it goes in, so a gather of
        whole slots may read past a prefix's end (and mask it) without meeting NaN."""
        if self._pool is None:
            raise RuntimeError("the prefix cache's pool is not allocated yet")
        return self._pool

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Release what a ``lookup`` returned for these keys (its first ``len(found)``)."""
        for key in keys:
            e = self._entries.get(key)
            if e is not None and e.pins > 0:
                e.pins -= 1

    def drop(self, keys: Sequence[BlockKey]) -> None:
        """Forget these entries and free their slots (claimed blocks whose KV never got in;
        one a later claim already took back is not this claim's any more and is left)."""
        for key in keys:
            e = self._entries.pop(key, None)
            if e is not None:
                self._free.extend(e.slots)

    def touch(self, chain: Sequence[BlockKey]) -> None:
        """Mark a chain recently used, its first block most recently: eviction then takes a
        chain's tail before its head, so what stays cached is always a usable prefix."""
        for key in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def insert(self, block: BlockId, kv: torch.Tensor, pin: bool = False) -> bool:
        """Copy one block's KV ``[layers, 2, kv_heads, n, head_dim]`` (``n = len(block.ids)
        <= block_size``, the pool's dtype) into a slot; with ``pin``, pinned as by
        ``lookup`` (so inserting the rest of a chain cannot evict its head). Returns whether
        the block is cached (and pinned, with ``pin``): False when the pool has no slot
        (budget below one block) or every slot is pinned."""
        e = self._entries.get(block.key)
        if e is not None:
            self._entries.move_to_end(block.key)
            e.pins += pin
            return True
        if self._pool is None:
            self.allocate(kv.shape[:3] + kv.shape[4:], kv.dtype, kv.device)
        assert self._pool is not None
        if (kv.shape[:3] + kv.shape[4:] != self._pool.shape[1:4] + self._pool.shape[5:]
                or kv.shape[3] > self.block_size or kv.dtype != self._pool.dtype):
            raise ValueError(f"block KV {tuple(kv.shape)} {kv.dtype} does not fit the cache's "
                             f"slots {tuple(self._pool.shape[1:])} {self._pool.dtype}")
        taken = self._take(1)
        if taken is None:
            return False
        slot = taken[0]
        try:
            self._pool[slot, :, :, :, : kv.shape[3]].copy_(kv)
            if kv.shape[3] < self.block_size:  # see ``pool``: no stale or uninitialised tail
                self._pool[slot, :, :, :, kv.shape[3]:].zero_()
        except BaseException:
            self._free.append(slot)
            raise
        self._entries[block.key] = _Entry(block, taken, int(pin))
        self.stats.inserts += 1
        return True

    def claim(self, blocks: Sequence[BlockId]) -> list[int]:
        """Slots for ``blocks`` (one chain's, head first) in bulk: each block not cached yet
        becomes an entry in a free slot (evicting least recently used unpinned entries), its
        KV to be copied in by the caller (one ``pool.index_copy_`` for many blocks, the
        partial block's unused positions zeroed: ``pool``'s invariant) before anything
        looks it up; a block already cached gets -1, and so does each block past what the
        pool can free (the chain keeps its head). A later claim may evict an entry claimed
        earlier whose KV is not in yet: ``held`` says which still are, and only those are
        copied. The caller then ``touch``es the chain (its head most recently used)."""
        entries = self._entries
        fresh = [b for b in blocks if b.key not in entries]
        kept = [entries[b.key] for b in blocks if b.key in entries]
        for e in kept:  # the chain's cached blocks are not this claim's to evict
            e.pins += 1
        try:
            given = dict(zip([b.key for b in fresh], self._take_upto(len(fresh))))
        finally:
            for e in kept:
                e.pins -= 1
        for b in fresh:
            if b.key in given:
                entries[b.key] = _Entry(b, [given[b.key]])
        self.stats.inserts += len(given)
        return [given[b.key] if b.key in given else -1 for b in blocks]

    def held(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bool]:
        """Whether each claimed block (``claim``) still holds its slot."""
        e = self._entries
        return [k in e and e[k].slots[0] == s for k, s in zip(keys, slots)]

    def insert_state(self, tail: BlockId, data: torch.Tensor) -> bool:
        """Copy a state snapshot (``data``: its bytes, ``[n]`` uint8 on the pool's device)
        for the prefix ending with ``tail`` into ``state_slots(n)`` slots, evicting as
        needed. Returns whether it is cached (False: the budget cannot hold it beside what
        is pinned). Already cached: marked recently used."""
        key = state_key(tail)
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if self._arena is None:
            raise RuntimeError("the prefix cache's pool is not allocated yet")
        n = self.state_slots(len(data))
        taken = self._take(n) if n else None
        if taken is None:
            return False
        pages = torch.zeros(n * self.slot_bytes, dtype=torch.uint8, device=data.device)
        pages[: len(data)] = data
        try:
            self._arena[torch.tensor(taken, device=self._arena.device)] = pages.view(n, -1)
        except BaseException:
            self._free.extend(taken)
            raise
        self._entries[key] = _Entry(tail, taken)
        self.stats.state_inserts += 1
        return True

    def allocate(self, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """Make the pool for blocks of ``block_shape = (layers, 2, kv_heads, head_dim)``:
        ``budget_bytes`` at most. On CPU its pages become resident only as slots are first
        written; on CUDA it is taken at once. The engine calls this when it is built, so a
        budget that cannot be had fails there, not in every batch."""
        layers, two, heads, dim = block_shape
        slot = layers * two * heads * self.block_size * dim * dtype.itemsize
        slots = self.budget_bytes // slot
        with torch.inference_mode(False):  # written under the engine's inference_mode later
            self._arena = torch.empty((slots, slot), dtype=torch.uint8, device=device)
        self._pool = self._arena.view(dtype).view(slots, layers, two, heads, self.block_size,
                                                  dim)
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._entries.clear()

    def _take_upto(self, n: int) -> list[int]:
        """Up to ``n`` free slots, evicting least recently used unpinned entries for them."""
        if len(self._free) < n:
            need = n - len(self._free)
            victims = []
            for key, e in self._entries.items():  # oldest first
                if need <= 0:
                    break
                if e.pins == 0:
                    victims.append(key)
                    need -= len(e.slots)
            for key in victims:
                self._free.extend(self._entries.pop(key).slots)
                self.stats.evictions += 1
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k:][::-1]  # as ``_take``: popped from the end
        del self._free[len(self._free) - k:]
        return taken

    def _take(self, n: int) -> list[int] | None:
        """``n`` free slots, evicting least recently used unpinned entries for them; None
        (and nothing evicted) if the unpinned entries cannot make up ``n``."""
        victims, have = [], len(self._free)
        for key, e in self._entries.items():  # oldest first; stops once there is room
            if have >= n:
                break
            if e.pins == 0:
                victims.append(key)
                have += len(e.slots)
        if have < n:
            return None
        for key in victims:
            self._free.extend(self._entries.pop(key).slots)
            self.stats.evictions += 1
        return [self._free.pop() for _ in range(n)]
