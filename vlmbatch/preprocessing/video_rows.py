"""Sampled frames -> each family's vision rows, as a ``PreparedVideo`` (``media.py``).

- Qwen-VL (``QwenVideoLayout``): every frame resized to one size, then laid out as
  transformers' ``pixel_values_videos`` (``Qwen2VLVideoProcessor.patchify``): frames padded
  to a multiple of the temporal patch ``T`` by repeating the last one, rows
  ``[t * h * w, C * T * P * P]`` running over temporal groups, then merge windows, then the
  patches inside a window, each row ``[c][t][py][px]``; ``grid`` is ``video_grid_thw``. The
  size: Qwen2-VL/2.5-VL's smart resize with the per-frame pixel bounds, Qwen3-VL/3.5's
  (``clip_budget``) with ``max_pixels`` over the whole clip (``smart_resize_clip``: its own
  rounding, transformers' ``video_processing_qwen3_vl.smart_resize``).
- InternVL (``FrameTiles``): each frame resized (stretched, as the processor's ``size``
  {height, width} does) to one ``S x S`` tile: rows ``[F, S, S, 3]``.

Rows stay uint8 (the vision module normalises). ``resize`` is OpenCV's policy
(``resize.py``) unless a plan names another (a test passes torchvision's, the processors'
own, and gets their pixels exactly). Group hashes cover a group's resized pixels and shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from vlmbatch.preprocessing.media import PreparedVideo
from vlmbatch.preprocessing.qwen2vl import smart_resize
from vlmbatch.preprocessing.qwen_vl import PatchGrid, QwenVLPreprocess
from vlmbatch.preprocessing.resize import resize as resize_policy
from vlmbatch.preprocessing.video import DecodedFrames

Resize = Callable[[np.ndarray, int, int], np.ndarray]  # (img [H, W, 3], width, height)


def smart_resize_clip(frames: int, height: int, width: int, temporal: int, factor: int,
                      min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video smart resize: ``[min_pixels, max_pixels]`` bound the pixels of the
    whole clip (frames rounded to ``temporal``), not of one frame; (height, width)."""
    if frames < temporal:
        raise ValueError(f"a Qwen3-VL clip needs >= {temporal} frames, got {frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio over 200 ({width}x{height}) is not supported")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class FrameGrid:
    """``ImageGrid`` of InternVL's clip: ``frames`` tiles of ``tile`` px, one per frame."""
    frames: int
    tile: int

    @property
    def key(self) -> str:
        return f"{self.frames}f{self.tile}"

    @property
    def dims(self) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True)
class QwenVideoLayout:
    """Qwen-VL's video rows: patch sizes and pixel bounds (per frame, or per clip with
    ``clip_budget``: Qwen3-VL, Qwen3.5)."""
    qwen: QwenVLPreprocess
    clip_budget: bool = False

    def target_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        q = self.qwen
        if self.clip_budget:
            return smart_resize_clip(frames, height, width, q.temporal, q.factor,
                                     q.min_pixels, q.max_pixels)
        return smart_resize(height, width, q.factor, q.min_pixels, q.max_pixels)


@dataclass(frozen=True)
class FrameTiles:
    """InternVL's video rows: one ``tile x tile`` tile per frame."""
    tile: int = 448


def _hash(parts: list[np.ndarray], meta: tuple[int, ...]) -> str:
    h = xxhash.xxh3_128()
    h.update(np.asarray(meta, dtype=np.int64).tobytes())
    for p in parts:
        h.update(np.asarray(p.shape, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(p).data)
    return h.hexdigest()


def qwen_rows(frames: np.ndarray, layout: QwenVideoLayout) -> np.ndarray:
    """Resized ``[F, h, w, 3]`` uint8 -> patch rows ``[t*gh*gw, 3*T*P*P]`` (module
    docstring), the last frame repeated up to a multiple of ``T``; one copy (the rows),
    written one temporal group at a time."""
    q = layout.qwen
    f, h, w, c = frames.shape
    p, m, t = q.patch, q.merge, q.temporal
    if c != 3 or h % q.factor or w % q.factor:
        raise ValueError(f"need [F, h, w, 3] with h, w multiples of {q.factor}; got "
                         f"{frames.shape}")
    gt, gh, gw = -(-f // t), h // p, w // p
    rows = np.empty((gt * gh * gw, c * t * p * p), np.uint8)
    for g, group in enumerate(_groups(frames, t)):
        x = group.reshape(t, gh // m, m, p, gw // m, m, p, c)
        # [T, wy, my, py, wx, mx, px, c] -> [wy, wx, my, mx, c, T, py, px]
        rows[g * gh * gw: (g + 1) * gh * gw] = x.transpose(1, 4, 2, 5, 7, 0, 3, 6).reshape(
            gh * gw, -1)
    return rows


def _groups(frames: np.ndarray, t: int) -> list[np.ndarray]:
    """The temporal groups of ``t`` frames, the last one padded with the last frame."""
    out = [frames[i: i + t] for i in range(0, len(frames), t)]
    if pad := t - len(out[-1]):
        out[-1] = np.concatenate([out[-1], np.repeat(frames[-1:], pad, axis=0)])
    return out


def prepare_qwen_video(decoded: DecodedFrames, indices: np.ndarray, fps: float,
                       layout: QwenVideoLayout) -> PreparedVideo:
    """Frames already resized to ``layout.target_size`` (``fit_for``) -> ``PreparedVideo``."""
    q = layout.qwen
    rows = qwen_rows(decoded.pixels, layout)
    h, w = decoded.pixels.shape[1:3]
    groups = _groups(decoded.pixels, q.temporal)
    grid = PatchGrid(len(groups), h // q.patch, w // q.patch, q.merge)
    hashes = tuple(_hash([g], (q.patch,)) for g in groups)
    return _record(rows, grid, hashes, decoded, indices, fps)


def prepare_internvl_video(decoded: DecodedFrames, indices: np.ndarray, fps: float,
                           tiles: FrameTiles) -> PreparedVideo:
    """Frames already resized to ``tile x tile`` -> ``PreparedVideo`` (rows ``[F, S, S, 3]``)."""
    rows = np.ascontiguousarray(decoded.pixels)
    groups = tuple(_hash([frame], (tiles.tile,)) for frame in rows)
    return _record(rows, FrameGrid(len(rows), tiles.tile), groups, decoded, indices, fps)


def _record(rows: np.ndarray, grid: PatchGrid | FrameGrid, groups: tuple[str, ...],
            decoded: DecodedFrames, indices: np.ndarray, fps: float) -> PreparedVideo:
    content = xxhash.xxh3_128("".join(groups).encode()).hexdigest()
    return PreparedVideo(rows=rows, grid=grid, group_hashes=groups, content_hash=content,
                         seconds=decoded.seconds, frame_indices=tuple(int(i) for i in indices),
                         fps=fps, width=decoded.width, height=decoded.height)


class FrameSize(Protocol):
    """What sizes a clip's frames: ``QwenVideoLayout`` or a budget over one
    (``video_budget.BudgetedLayout``)."""

    def target_size(self, frames: int, height: int, width: int) -> tuple[int, int]: ...


def fit_for(layout: FrameSize | FrameTiles, frames: int,
            resize: Resize | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """The per-frame resize of a clip of ``frames`` sampled frames, planned once on the
    first frame's (display-oriented) size: every frame gets that size, so a stream whose
    resolution changes midway still stacks."""
    rs = resize or resize_policy
    planned: list[tuple[int, int]] = []

    def fit(img: np.ndarray) -> np.ndarray:
        if not planned:
            planned.append((layout.tile, layout.tile) if isinstance(layout, FrameTiles)
                           else layout.target_size(frames, *img.shape[:2]))
        th, tw = planned[0]
        return rs(img, tw, th)
    return fit
