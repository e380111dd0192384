"""The decoder process (``python -m preprocessing.decoder_process ...``): reads, decodes and
tiles one image at a time for ``preprocessing.isolated.DecoderPool``, which may kill it.

Started by exec (not fork), it imports only ``preprocessing`` (numpy, OpenCV, Pillow,
xxhash: ~50 MB, ~0.25 s), never torch. Protocol over two pipes (``Connection`` framing,
pickles): the pool sends ``(plan, max_pixels, before)`` once and is answered ``("ready",
pid)``; then each ``(source, base_dir, slot offset)`` is answered, in order, by one of

    ("slot", image, layout)  the PreparedImage with its arrays replaced by empty ones, and
                             (field, offset, shape, dtype) of each array in the shared slot
    ("object", image)        the whole PreparedImage, pickled (it did not fit the slot)
    ("error", exc)           SourceError or ImageError (VideoError too): the item's error

A ``VideoSource`` as the source is a clip: read like an image's bytes, prepared by its own
``VideoPlan`` (sampled, decoded as sampled, laid out as rows), and answered the same way
with a ``PreparedVideo``; the pool's image plan is not used for it.
    ("raise", exc)           anything else (a bug): raised in the caller

The two slots are one memfd both processes map; the pool copies an item's arrays out
before it sends the item after next, which reuses that slot. The process dies with the
pool's (``PR_SET_PDEATHSIG``) and leaves SIGINT and SIGTERM to it: a Ctrl-C in a terminal
reaches every process of the group, and the pool, not this process, decides when decoding
stops.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import pickle
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from vlmbatch.preprocessing.decode import ImageError
from vlmbatch.preprocessing.media import MediaPart, WindowedClip
from vlmbatch.preprocessing.prepare import ImagePlan, prepare_bytes
from vlmbatch.preprocessing.sources import SourceError, read_bytes
from vlmbatch.preprocessing.video_source import VideoSource

ALIGN = 64  # bytes; each array starts on a cache line of the slot
PR_SET_PDEATHSIG = 1


def pack_media(image: MediaPart | WindowedClip, slot: mmap.mmap, base: int, size: int,
               ) -> tuple:
    """``image``'s arrays copied into the ``size`` bytes of ``slot`` from ``base`` (a
    ``("slot", ...)`` answer), or the whole image pickled when they do not fit."""
    arrays = [(f.name, v) for f in dataclasses.fields(image)
              if isinstance(v := getattr(image, f.name), np.ndarray)]
    layout, offset = [], base
    for name, a in arrays:
        layout.append((name, offset, a.shape, a.dtype.str))
        offset += -(-a.nbytes // ALIGN) * ALIGN
    if offset - base > size:
        return ("object", image)
    for (_, off, shape, dtype), (_, a) in zip(layout, arrays):
        np.frombuffer(slot, np.dtype(dtype), a.size, off).reshape(shape)[...] = a
    empty: dict[str, Any] = {name: np.empty(0, a.dtype) for name, a in arrays}
    return ("slot", dataclasses.replace(image, **empty), layout)


def unpack_media(answer: tuple, slot: mmap.mmap, base: int = 0,
                 ) -> MediaPart | WindowedClip:
    """The ``PreparedImage`` (or ``PreparedVideo``) of a ``slot`` or ``object`` answer, its
    arrays copied out of ``slot`` (which a later item overwrites; the offsets in the answer
    include ``base``)."""
    if answer[0] == "object":
        return answer[1]
    _, image, layout = answer
    arrays: dict[str, Any] = {
        name: np.frombuffer(slot, np.dtype(dtype), int(np.prod(shape)), off).reshape(shape).copy()
        for name, off, shape, dtype in layout}
    return dataclasses.replace(image, **arrays)


def answer(source: str | bytes | VideoSource, base_dir: str, plan: ImagePlan, max_pixels: int,
           before: Callable[[str], None] | None, slot: mmap.mmap, base: int = 0,
           size: int | None = None) -> tuple:
    """One item's answer, its arrays in ``slot[base: base + size]`` (see the module
    docstring)."""
    try:
        where = source.source if isinstance(source, VideoSource) else source
        if before is not None:  # fault injection (tests): hang or crash here
            before(where if isinstance(where, str) else "<bytes>")
        data = where if isinstance(where, bytes) else read_bytes(where, Path(base_dir))
        image = (source.plan.prepare(data, max_pixels) if isinstance(source, VideoSource)
                 else prepare_bytes(data, plan, max_pixels))
        return pack_media(image, slot, base, len(slot) - base if size is None else size)
    except (SourceError, ImageError) as e:
        return ("error", e)
    except Exception as e:  # noqa: BLE001  (a bug: the pool raises it in the caller)
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        return ("raise", e)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the pool's process dies, kill -9 included (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def main(argv: list[str]) -> None:
    rfd, wfd, memfd, size, parent = (int(x) for x in argv)
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cv2.setNumThreads(1)  # one image at a time; the pool's workers are the parallelism
    if "OPENCV_LOG_LEVEL" not in os.environ:  # each failure is already the item's error
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
    rd, wr = Connection(rfd, writable=False), Connection(wfd, readable=False)
    slots = mmap.mmap(memfd, 2 * size)  # two slots: the pool says which each item uses
    os.close(memfd)
    setup: Any = rd.recv()
    plan, max_pixels, before = setup
    wr.send(("ready", os.getpid()))
    while True:
        try:
            msg = rd.recv()
        except EOFError:  # the pool closed its end
            return
        if msg is None:
            return
        source, base_dir, base = msg
        wr.send(answer(source, base_dir, plan, max_pixels, before, slots, base, size))


if __name__ == "__main__":
    main(sys.argv[1:])
