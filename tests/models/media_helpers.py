"""Clips and image lists for the multi-part prompt tests: Qwen-VL video patch rows made from
uint8 frames in transformers' ``pixel_values_videos`` order (checked against its video
processor in ``test_qwen_vl_media.py``), wrapped as the ``PreparedVideo`` the decoding side
produces."""

from __future__ import annotations

import numpy as np
import xxhash

from vlmbatch.preprocessing.media import PreparedVideo
from vlmbatch.preprocessing.qwen_vl import PatchGrid


def video_rows(frames: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """uint8 frames ``[F, H, W, 3]`` (F a multiple of ``temporal``, sides multiples of
    patch * merge) -> rows ``[t*gh*gw, 3*T*P*P]``: temporal patch, merge window row-major,
    patch in the window; inside a row channel, frame, pixel row, pixel column."""
    f, h, w, c = frames.shape
    t, gh, gw, m, p = f // temporal, h // patch, w // patch, merge, patch
    x = frames.reshape(t, temporal, gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [t, wy, wx, my, mx, c, T, py, px]
    return np.ascontiguousarray(x).reshape(t * gh * gw, c * temporal * p * p)


def clip(frames: np.ndarray, patch: int, merge: int, temporal: int, *, src_fps: float,
         indices: list[int], fps: float) -> PreparedVideo:
    """A sampled clip of ``frames`` (already at the grid's size), taken at source frame
    ``indices`` of a ``src_fps`` clip, sampled at ``fps``."""
    rows = video_rows(frames, patch, merge, temporal)
    t, h, w = len(frames) // temporal, frames.shape[1] // patch, frames.shape[2] // patch
    groups = tuple(xxhash.xxh3_128(frames[i: i + temporal].tobytes()).hexdigest()
                   for i in range(0, len(frames), temporal))
    return PreparedVideo(rows, PatchGrid(t, h, w, merge), groups,
                         xxhash.xxh3_128("".join(groups).encode()).hexdigest(),
                         tuple(i / src_fps for i in indices), tuple(indices), fps,
                         frames.shape[2], frames.shape[1])


def random_frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)
