"""A long clip cut into windows (``segment_seconds``, ``segment_stride``), each sampled as its
family samples a clip of that span.

**Window arithmetic** (``window_spans``), in seconds of the clip, ``D`` its duration
(``ClipInfo.duration``: the last frame's time + one frame), ``W`` the window, ``S`` the stride
(default ``W``):

- windows start at ``0, S, 2S, ...`` and span ``[kS, kS + W)`` while ``kS + W <= D``;
- the clip's end is always seen: when no such window reaches ``D`` (the last one ends
  before it, or the clip is shorter than one window), one more window ends at the clip's
  end, ``[max(0, D - W), D)``. There is no partial window: every window spans ``min(W, D)``
  seconds, so each is sampled as a clip of one length (a partial tail would sample fewer
  frames, or be too short for ``num_frames``). That last window starts off the stride's grid
  unless ``D - W`` is a multiple of ``S``;
- a clip shorter than one window is one window, the whole clip;
- ``S > W`` leaves gaps between windows (the seconds in a gap are not seen), except that
  the clip's end is;
- bounds compare with a tolerance of ``EPS`` (1 us), far below any frame interval, so that a
  frame at exactly ``kS`` is in window ``k`` whatever the float rounding of the times.

**A window's frames** are the source frames whose presentation time ``t`` (seconds from
the first frame) has ``start <= t < end``: a run ``[first, stop)`` of frame numbers.

**Sampling a window** (``prepare_windows``): the family's rule (``VideoSampling.indices``)
applied to a clip made of those frames alone: ``ClipInfo(stop - first, the source's fps,
(stop - first) / fps)``; the indices it gives are shifted by ``first``. So a window is
sampled exactly as a clip cut out at its bounds would be, and two windows on one grid (half
overlap, say) pick the same source frames where they overlap whenever the sampling step
divides the stride (every frame group then coincides: each is decoded and encoded once).
The sampled fps of a window (Qwen2.5-VL's time positions) is its sampled frames / its
frames x the source fps, as for a clip.

**Decoding**: the clip is opened once; windows of one sampled frame count share one resize
(``fit_for``), and the union of their frames is decoded once, in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vlmbatch.preprocessing.media import PreparedVideo, WindowedClip
from vlmbatch.preprocessing.video import Clip, DecodedFrames, VideoError, open_clip
from vlmbatch.preprocessing.video_rows import (
    FrameSize,
    FrameTiles,
    QwenVideoLayout,
    Resize,
    fit_for,
    prepare_internvl_video,
    prepare_qwen_video,
)
from vlmbatch.preprocessing.video_sampling import ClipInfo, SamplingError, VideoSampling

EPS = 1e-6  # seconds: the tolerance of window bounds against frame times


@dataclass(frozen=True)
class Window:
    """One window: its span in seconds and its frames ``[first, stop)`` (source numbers)."""
    start: float
    end: float
    first: int
    stop: int


def window_spans(duration: float, seconds: float, stride: float | None = None,
                 ) -> list[tuple[float, float]]:
    """The windows ``[start, end)`` of a clip of ``duration`` seconds (module docstring)."""
    step = seconds if stride is None else stride
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(step) and step > 0):
        raise ValueError(f"windows need seconds and a stride > 0, got {seconds}, {stride}")
    if duration <= seconds + EPS:
        return [(0.0, duration)]
    spans: list[tuple[float, float]] = []
    k = 0
    while k * step + seconds <= duration + EPS:
        spans.append((k * step, k * step + seconds))
        k += 1
    if spans[-1][1] < duration - EPS:
        spans.append((duration - seconds, duration))
    return spans


def windows_of(times: np.ndarray, duration: float, seconds: float,
               stride: float | None = None) -> list[Window]:
    """``window_spans`` with each window's frames, from the frames' times (ascending,
    seconds from the first frame); VideoError (``too_short``) for a window holding no frame
    (``segment_seconds`` shorter than the gap between two frames)."""
    out = []
    for start, end in window_spans(duration, seconds, stride):
        first = int(np.searchsorted(times, start - EPS, side="left"))
        stop = int(np.searchsorted(times, end - EPS, side="left"))
        if stop <= first:
            raise VideoError(f"the window [{start:.3f}, {end:.3f}) s holds no frame: "
                             f"segment_seconds {seconds:g} is shorter than the clip's frame "
                             "interval (raise segment_seconds)", "too_short")
        out.append(Window(start, end, first, stop))
    return out


@dataclass(frozen=True)
class WindowRecipe:
    """What a window is prepared with: a ``VideoPlan``'s sampling, layout, resize and
    length limit (``VideoPlan.prepare`` builds it; this module does not import the plan's)."""
    sampling: VideoSampling
    layout: QwenVideoLayout | FrameTiles
    resize: Resize | None
    max_seconds: float
    # the size frames are resized to (a token budget's ``BudgetedLayout``; None: ``layout``)
    sized: FrameSize | FrameTiles | None = None
    # a window's frames from its ``ClipInfo`` (a budget's fewer InternVL frames; None: the
    # sampling's rule)
    pick: Callable[[ClipInfo], np.ndarray] | None = None


def prepare_windows(plan: WindowRecipe, data: bytes, max_pixels: int, seconds: float,
                    stride: float | None = None) -> WindowedClip:
    """Encoded clip -> each window's ``PreparedVideo`` (module docstring); raises
    ``VideoError`` (the item's error) as ``VideoPlan.prepare`` does."""
    with open_clip(data, max_pixels, plan.max_seconds) as clip:
        info = clip.info
        times = np.asarray([clip.index.seconds(k) for k in range(info.total_frames)])
        windows = windows_of(times, info.duration, seconds, stride)
        picks = []
        for w in windows:
            n = w.stop - w.first
            try:
                rel = (plan.pick or plan.sampling.indices)(ClipInfo(n, info.fps, n / info.fps))
            except SamplingError as e:
                raise VideoError(f"cannot sample the window [{w.start:.3f}, {w.end:.3f}) s: "
                                 f"{e}", "too_short") from None
            picks.append(rel + w.first)
        decoded = _decode_once(clip, plan, picks)
    videos: list[PreparedVideo] = []
    for w, idx in zip(windows, picks):
        fps = len(idx) / (w.stop - w.first) * info.fps
        d = decoded[len(idx)]
        rows = np.stack([d.pixels[d.where[int(i)]] for i in idx])
        frames = DecodedFrames(rows, tuple(d.seconds[d.where[int(i)]] for i in idx),
                               d.width, d.height)
        videos.append(prepare_internvl_video(frames, idx, fps, plan.layout)
                      if isinstance(plan.layout, FrameTiles)
                      else prepare_qwen_video(frames, idx, fps, plan.layout))
    spans = tuple((round(float(w.start), 3), round(float(w.end), 3)) for w in windows)
    return WindowedClip(tuple(videos), spans)


@dataclass(frozen=True)
class _Decoded:
    """The frames of every window of one sampled count, decoded once: ``pixels[where[k]]``
    is source frame ``k`` resized."""
    pixels: np.ndarray
    seconds: tuple[float, ...]
    where: dict[int, int]
    width: int
    height: int


def _decode_once(clip: Clip, plan: WindowRecipe, picks: list[np.ndarray]) -> dict[int, _Decoded]:
    """Per sampled frame count (one resize each: ``fit_for``), the union of those windows'
    frames decoded in one ascending pass."""
    out = {}
    for count in sorted({len(p) for p in picks}):
        union = np.unique(np.concatenate([p for p in picks if len(p) == count]))
        got = clip.frames(union, fit_for(plan.sized or plan.layout, count, plan.resize))
        out[count] = _Decoded(got.pixels, got.seconds, {int(k): j for j, k in enumerate(union)},
                              got.width, got.height)
    return out
