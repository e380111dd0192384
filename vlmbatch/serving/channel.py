"""The local channel between the HTTP process and one engine process (``engines.py`` the
HTTP side, ``engine_process.py`` the other), carrying ``messages.py``'s records.

    HTTP process                                         engine process
    Arena.put(image) -> pixels into a memfd region ──┐
    Link.send(Ask(rid, question, packed)) ───────────┴─> reader thread: Arena.view (no copy)
                                                         -> the engine thread's queue
    reader thread: futures settled, regions freed  <──── one message per engine-thread turn:
                                                         Settled([Reply(rid, Score)], stats)

Two pipes carry small pickled records (``Link``: ``multiprocessing.connection`` framing, the
write side locked, both pipes enlarged to 1 MiB so a burst of requests never blocks the
event loop on a busy engine). Pixels never go through a pipe: the HTTP process copies an
image's uint8 rows (and any other array of its ``PreparedImage``) into a region of the
engine's ``Arena``, a memfd both processes map, and sends the region's layout; the engine
reads them in place (``Arena.view``: numpy views, no copy) and the HTTP process frees the
region when the request's answer comes back, so a region is never reused while the engine
may still read it. An image that does not fit the free space travels pickled instead.

``Arriving`` is the one number both sides share outside the pipes: how many requests are
between arrival and queueing in the HTTP process (an 8-byte counter in its own memfd,
written by the HTTP process only), read by the engine thread when it decides whether to
wait for more before an engine call.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import fcntl
import mmap
import os
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from vlmbatch.engine.records import Item, MediaItem
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.serving.messages import Packed

ALIGN = 64  # bytes: each array starts on a cache line
ARENA_BYTES = 1 << 30  # per engine process, sparse: pages are allocated as first written
PIPE_BYTES = 1 << 20  # F_SETPIPE_SZ: Linux's default limit for an unprivileged process
F_SETPIPE_SZ = 1031

RESIDENT_BYTES = 256 << 20  # unused images an arena keeps, most recently used first
_FIELDS: dict[type, tuple[str, ...]] = {}  # a record type's field names, read once


def _arrays(image: PreparedImage) -> list[tuple[str, np.ndarray]]:
    names = _FIELDS.get(type(image))
    if names is None:
        names = _FIELDS[type(image)] = tuple(f.name for f in dataclasses.fields(image))
    return [(n, v) for n in names if isinstance(v := getattr(image, n), np.ndarray)]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Arena:
    """A memfd of ``size`` bytes both processes map; regions are allocated first-fit (and
    freed, adjacent free blocks merged) by the HTTP process only, under a lock."""

    def __init__(self, size: int = ARENA_BYTES, fd: int | None = None) -> None:
        self.owner = fd is None
        self.fd = os.memfd_create("vlmbatch-engine-arena") if fd is None else fd
        if self.owner:
            os.ftruncate(self.fd, size)
        self.size = size
        self.map = mmap.mmap(self.fd, size)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), by offset
        self._lock = threading.Lock()
        self.used = 0

    def _alloc(self, n: int) -> int | None:
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= n:
                    self._free[i:i + 1] = [(off + n, size - n)] if size > n else []
                    self.used += n
                    return off
        return None

    def free(self, region: tuple[int, int] | None) -> None:
        if region is None:
            return
        off, n = region
        with self._lock:
            self.used -= n
            i = bisect.bisect(self._free, (off, n))
            self._free.insert(i, (off, n))
            # merge with the next, then with the previous block
            if i + 1 < len(self._free) and off + n == self._free[i + 1][0]:
                self._free[i:i + 2] = [(off, n + self._free[i + 1][1])]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                prev = self._free[i - 1]
                self._free[i - 1:i + 1] = [(prev[0], prev[1] + self._free[i][1])]

    def put(self, image: PreparedImage) -> Packed:
        """``image`` as the engine will read it: its arrays copied into a new region (freed
        by ``free(packed.region)``), or the whole image pickled when none is free."""
        arrays = _arrays(image)
        need = sum(_aligned(a.nbytes) for _, a in arrays)
        base = self._alloc(need) if need else None
        if base is None:
            return Packed(image)
        layout, off = [], base
        for name, a in arrays:
            np.frombuffer(self.map, np.uint8, a.nbytes, off)[...] = \
                np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            layout.append((name, off, tuple(a.shape), a.dtype.str))
            off += _aligned(a.nbytes)
        empty: dict[str, Any] = dict.fromkeys(name for name, _ in arrays)  # None: in the arena
        return Packed(dataclasses.replace(image, **empty), tuple(layout), (base, need),
                      image.cache_key)

    def view(self, packed: Packed) -> PreparedImage:
        """The engine side: the image with its arrays as views of the region (read-only use;
        valid until the HTTP process frees the region, after this request is answered)."""
        if packed.layout is None:
            return packed.meta
        arrays: dict[str, Any] = {
            name: np.frombuffer(self.map, np.dtype(dtype), int(np.prod(shape)), off)
            .reshape(shape) for name, off, shape, dtype in packed.layout}
        return dataclasses.replace(packed.meta, **arrays)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view still held (the engine side at exit): the OS unmaps it
            pass
        os.close(self.fd)


class Residents:
    """Prepared images kept in an ``Arena`` by cache key (the HTTP process's side): a
    request ``hold``s its image (copied in only if not there already) and ``release``s it
    when answered; an image no request holds stays, most recently used last, until the
    unused ones pass ``budget`` bytes or the arena needs their room. So an image asked about
    again is not copied again, and a region is freed only once nothing may read it."""

    def __init__(self, arena: Arena, budget: int = RESIDENT_BYTES) -> None:
        self.arena, self.budget = arena, budget
        self._held: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0  # of the images kept

    def hold(self, image: Item) -> Packed:
        if isinstance(image, MediaItem):  # several images or a clip: pickled whole
            return Packed(image)
        key = image.cache_key
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:
                entry[1] += 1
                self._held.move_to_end(key)
                return entry[0]
        packed = self.arena.put(image)
        if packed.region is None:  # no room: the unused go, then once more
            with self._lock:
                self._evict(0)
            packed = self.arena.put(image)
            if packed.region is None:
                return packed  # pickled whole: nothing to hold
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:  # another request put it meanwhile: theirs is kept
                self.arena.free(packed.region)
                entry[1] += 1
                return entry[0]
            self._held[key] = [packed, 1]
            self.bytes += packed.region[1]
            self._evict(self.budget)
        return packed

    def release(self, packed: Packed | None) -> None:
        if packed is None or packed.region is None:
            return
        with self._lock:
            entry = self._held.get(packed.key)
            if entry is not None and entry[0] is packed:
                entry[1] -= 1
            self._evict(self.budget)

    def _evict(self, budget: int) -> None:
        """Free unused images, least recently used first, until ``bytes <= budget`` (under
        the lock)."""
        if self.bytes <= budget:
            return
        for key in [k for k, e in self._held.items() if e[1] == 0]:
            if self.bytes <= budget:
                return
            packed, _ = self._held.pop(key)
            self.bytes -= packed.region[1]
            self.arena.free(packed.region)


class Arriving:
    """A counter in shared memory: incremented and decremented by the HTTP process (under a
    lock), read by engine processes (an aligned 8-byte load: never torn)."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.memfd_create("vlmbatch-arriving") if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, 8)
        self.map = mmap.mmap(self.fd, 8)
        self.cell = np.frombuffer(self.map, np.int64, 1)
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.cell[0] += n

    def __call__(self) -> int:
        return int(self.cell[0])


class Link:
    """One direction of pipe each way: ``send`` (thread-safe) and ``recv`` of pickled
    records (``messages.py``)."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        for fd in (read_fd, write_fd):
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # over the system's limit: the default size still works
                pass
        self.rd = Connection(read_fd, writable=False)
        self.wr = Connection(write_fd, readable=False)
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.wr.send_bytes(data)

    def recv(self) -> Any:
        return pickle.loads(self.rd.recv_bytes())

    def close(self) -> None:
        for c in (self.rd, self.wr):
            try:
                c.close()
            except OSError:
                pass
