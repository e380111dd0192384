"""What an item holds beyond one still image (issue 44's doors): several images in prompt
order (``ImageList``) or a clip with its sampling keys (``VideoInput``). They stand where an
``ImageItem``'s image stands; stage 1 prepares them (``pipeline/preparers.py``) into one
``MediaItem`` (``engine/records.py``) the engine writes into one prompt.

Light (no decoder, no torch): manifests, job stores and Ray prepare workers read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from vlmbatch.preprocessing.sources import MemberRef, NotAnImage, RowRef

# the most images one item may hold: each is its own vision tokens in one prompt, so a
# larger list is refused naming the item, as vLLM's ``limit_mm_per_prompt`` refuses one
MAX_IMAGES = 64
SAMPLING_KEYS = ("fps", "num_frames", "max_frames", "max_video_tokens", "segment_seconds",
                 "segment_stride")


@dataclass(frozen=True)
class ImageList:
    """Several images asked about in one prompt, in order (``"images": [...]``)."""
    images: tuple[str | bytes | np.ndarray | RowRef | MemberRef | NotAnImage, ...]  # ImageSource
    per_image: bool = False  # each image asked alone, not one prompt (pipeline/parts.py)

    def describe(self) -> str:
        """How messages name the list: its first images' paths or URLs."""
        names = [s if isinstance(s, str) else f"image {k + 1}" for k, s in
                 enumerate(self.images)]
        more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        return ", ".join(names[:3]) + more


@dataclass(frozen=True)
class SamplingKeys:
    """A user's sampling keys (a line's, a run's): ``fps`` or ``num_frames`` (not both), and
    ``max_frames``; None: the checkpoint's video processor's (``preprocessing/video_plan.py``).
    ``check_sampling`` validates them. ``segment_seconds``: the clip asked in windows of
    that many seconds, every ``segment_stride`` (None: ``segment_seconds``;
    ``preprocessing/video_windows.py``)."""
    fps: float | None = None
    num_frames: int | None = None
    max_frames: int | None = None
    max_video_tokens: int | None = None  # the clip's visual token budget (video_plan.py)
    segment_seconds: float | None = None
    segment_stride: float | None = None

    def over(self, run: SamplingKeys) -> SamplingKeys:
        """These keys where set, else ``run``'s (a line's fps replaces a run's num_frames;
        a line's segment_seconds its stride too)."""
        rate = (self.fps, self.num_frames) if self.fps or self.num_frames else \
            (run.fps, run.num_frames)
        windows = (self.segment_seconds, self.segment_stride) if self.segment_seconds else \
            (run.segment_seconds, run.segment_stride)
        return SamplingKeys(*rate, self.max_frames or run.max_frames,
                            self.max_video_tokens or run.max_video_tokens, *windows)


@dataclass(frozen=True)
class VideoInput:
    """A clip and how to sample it (``"video": "clip.mkv"``): a path (relative to the item's
    ``base_dir``), a file://, data:, http(s):// or object-store URL, or its bytes."""
    source: str | bytes
    sampling: SamplingKeys = SamplingKeys()


def video(source: str | Path | bytes, *, fps: float | None = None,
          num_frames: int | None = None, max_frames: int | None = None,
          max_video_tokens: int | None = None, segment_seconds: float | None = None,
          segment_stride: float | None = None) -> VideoInput:
    """A clip to ask about (``vlmbatch.video``: the Python API's ``ask``/``ImageItem`` take
    it where an image goes), sampled at ``fps`` or as ``num_frames`` frames, at most
    ``max_frames`` (None: the checkpoint's video processor's, or the run's), in at most
    ``max_video_tokens`` visual tokens (None: the run's, else no budget); with
    ``segment_seconds``, asked window by window (every ``segment_stride`` seconds), each
    window sampled so; ValueError for a bad key."""
    keys = check_sampling({"fps": fps, "num_frames": num_frames, "max_frames": max_frames,
                           "max_video_tokens": max_video_tokens,
                           "segment_seconds": segment_seconds,
                           "segment_stride": segment_stride}, "video")
    return VideoInput(str(source) if isinstance(source, Path) else source, keys)


def each_image(images: Sequence[Any]) -> ImageList:
    """Images each asked alone (``vlmbatch.each_image``: where an image goes), with one
    answer per question saying which image triggered (``pipeline/parts.py``); ValueError
    for an empty list or one over ``MAX_IMAGES``. Each is kept as ``ImageItem`` keeps an
    image (a path, URL, bytes, PIL image or array)."""
    check_images(images, "each_image")
    return ImageList(tuple(images), per_image=True)


def check_sampling(raw: dict[str, Any], where: str) -> SamplingKeys:
    """``raw``'s sampling keys checked: ValueError naming ``where`` and the key when one is
    not a positive number (``fps``) or whole number (the frame counts), or both ``fps`` and
    ``num_frames`` are given (transformers refuses them together)."""
    fps, num, most, budget, segment, stride = (raw.get(k) for k in SAMPLING_KEYS)
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                            or not math.isfinite(fps) or fps <= 0):
        raise ValueError(f"{where}: fps must be a number > 0, got {fps!r}")
    for key, v in (("num_frames", num), ("max_frames", most), ("max_video_tokens", budget)):
        if v is not None and (type(v) is not int or v < 1):
            raise ValueError(f"{where}: {key} must be a whole number >= 1, got {v!r}")
    if fps is not None and num is not None:
        raise ValueError(f"{where}: give fps or num_frames, not both (fps samples by time, "
                         "num_frames a fixed count)")
    if stride is not None and segment is None:
        raise ValueError(f"{where}: segment_stride needs segment_seconds (the window)")
    for key, v in (("segment_seconds", segment), ("segment_stride", stride)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v <= 0):
            raise ValueError(f"{where}: {key} must be a number of seconds > 0, got {v!r}")
    return SamplingKeys(None if fps is None else float(fps), num, most, budget,
                        None if segment is None else float(segment),
                        None if stride is None else float(stride))


def check_images(images: object, where: str, count: bool = True) -> None:
    """ValueError naming ``where`` unless ``images`` is a list of 1 to ``MAX_IMAGES`` (with
    ``count`` false: a list; a manifest leaves the count to stage 1, where it is the item's
    error: ``preparers.list_refused``)."""
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"{where}: 'images' must be a list of images, got "
                         f"{type(images).__name__}")
    if not count:
        return
    if not images:
        raise ValueError(f"{where}: 'images' is empty; give at least one image (or 'image')")
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{where}: {len(images)} images in one item, over the limit of "
                         f"{MAX_IMAGES}; split the item, or ask about a clip ('video')")
