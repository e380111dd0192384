"""A clip's bytes -> its sampled frames, RGB uint8, decoded as sampled (PyAV, FFmpeg).

``open_clip`` reads the clip's metadata without decoding a frame: it demuxes the video
stream's packets once (no pixel work) for every frame's presentation time and the key
frames, so the frame count is exact whatever the container claims (Matroska claims none),
and a variable-frame-rate clip's frame ``k`` is its ``k``-th frame in presentation order, at
its own time. ``ClipInfo.fps`` is the stream's average rate (transformers' PyAV reader reads
the same), else frames / duration.

``Clip.frames(indices)`` decodes only what the indices need: for each wanted frame it seeks
to the key frame at or before it, unless the decoder is already past that key frame (then
decoding on is cheaper), and decodes forward to it. Frames are ``to_ndarray("rgb24")`` as
transformers' PyAV reader converts them, so on any clip they equal decode-everything-then-
index (tested on lossless clips). The display matrix is applied (a phone's portrait clip
reaches the model upright, as a person sees it); ``seconds`` is each frame's presentation
time from the stream's first frame.

Limits, checked before any frame is decoded: frames over ``max_pixels`` (``--max-pixels``,
per frame) and clips over ``max_seconds`` raise ``VideoTooLarge``. Every failure raises
``VideoError`` (an ``ImageError``: the pipeline maps it to the item's error kind as an
image's, ``decode`` or ``too_large``), its ``reason`` one of ``REASONS``.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.limits import DEFAULT_MAX_VIDEO_SECONDS as DEFAULT_MAX_VIDEO_SECONDS
from vlmbatch.preprocessing.video_sampling import ClipInfo

REASONS = ("not_a_video", "no_video_stream", "no_frames", "truncated", "unsupported_codec",
           "too_many_pixels", "too_long", "too_short", "over_budget", "over_context")


class VideoError(ImageError):
    """A clip could not be read or decoded; the message names the reason (``REASONS``)."""

    def __init__(self, message: str, reason: str = "truncated") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickled across the decoder process's pipe
        return type(self), (str(self), self.reason)


class VideoTooLarge(VideoError, ImageTooLarge):
    """Frames over the per-frame pixel limit, a clip over ``max_seconds``, or over its token
    budget or the model's context (``video_budget.py``)."""


@dataclass(frozen=True)
class ClipIndex:
    """What demuxing found: each frame's pts in presentation order, the key frames' pts."""
    pts: np.ndarray  # int64, ascending
    keys: np.ndarray  # int64, ascending
    time_base: Fraction

    def seconds(self, k: int) -> float:
        return float((int(self.pts[k]) - int(self.pts[0])) * self.time_base)

    def key_before(self, pts: int) -> int:
        """The pts of the last key frame at or before ``pts`` (the first frame if none)."""
        i = bisect.bisect_right(self.keys.tolist(), pts) - 1
        return int(self.keys[i]) if i >= 0 else int(self.pts[0])


@dataclass(frozen=True)
class DecodedFrames:
    """Sampled frames, each already ``fit`` (resized) as decoded: ``[T, h, w, 3]`` uint8."""
    pixels: np.ndarray
    seconds: tuple[float, ...]
    width: int  # of the source frames, display orientation applied
    height: int


class Clip:
    """An open clip (``open_clip``): ``info`` and ``index`` read, frames decoded on demand.
    A context manager; closing it frees FFmpeg's buffers."""

    def __init__(self, container: av.container.InputContainer, stream: av.VideoStream,
                 index: ClipIndex, info: ClipInfo) -> None:
        self.container, self.stream, self.index, self.info = container, stream, index, info
        self.decoded = 0  # frames the decoder has output so far (what seeking saved: bench)

    def __enter__(self) -> Clip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.container.close()

    def frames(self, indices: np.ndarray,
               fit: Callable[[np.ndarray], np.ndarray] | None = None) -> DecodedFrames:
        """Frames ``indices`` (ascending, repeats allowed), each RGB, display-oriented, then
        ``fit`` (a resize: only the fitted frames are kept)."""
        idx = [int(i) for i in indices]
        if not idx or min(idx) < 0 or max(idx) >= self.info.total_frames:
            raise ValueError(f"frame indices {idx[:8]} not within the clip's "
                             f"{self.info.total_frames} frames")
        wanted = sorted(set(idx))
        where: dict[int, list[int]] = {}
        for pos, k in enumerate(idx):
            where.setdefault(k, []).append(pos)
        out: np.ndarray | None = None  # allocated at the first frame: no second full copy
        size = (0, 0)
        for k, frame in zip(wanted, self._decode_at([int(self.index.pts[k]) for k in wanted])):
            rgb = _oriented(frame)
            size = rgb.shape[1], rgb.shape[0]
            fitted = fit(rgb) if fit is not None else rgb
            if out is None:
                out = np.empty((len(idx), *fitted.shape), np.uint8)
            out[where[k]] = fitted
        assert out is not None  # idx is not empty
        return DecodedFrames(out, tuple(self.index.seconds(k) for k in idx), *size)

    def _decode_at(self, targets: list[int]) -> Iterator[av.VideoFrame]:
        """The frame at each pts of ``targets`` (ascending), seeking only where decoding on
        from where the decoder is would cost more (module docstring)."""
        frames: Iterator[av.VideoFrame] | None = None
        last: int | None = None  # pts of the last frame decoded
        for target in targets:
            key = self.index.key_before(target)
            if frames is None or last is None or last >= target or key > last:
                self.container.seek(key, stream=self.stream, backward=True, any_frame=False)
                frames, last = self._decode(), None
            for frame in frames:
                last = frame.pts if frame.pts is not None else last
                if frame.pts is not None and frame.pts >= target:
                    yield frame
                    break
            else:
                raise VideoError(f"frame at pts {target} could not be decoded: the clip is "
                                 "truncated or corrupt", "truncated")

    def _decode(self) -> Iterator[av.VideoFrame]:
        try:
            for frame in self.container.decode(self.stream):
                self.decoded += 1
                yield frame
        except av.FFmpegError as e:
            raise VideoError(f"cannot decode the clip ({e}): truncated or corrupt",
                             "truncated") from None


def _oriented(frame: av.VideoFrame) -> np.ndarray:
    """The frame as ``[H, W, 3]`` uint8 RGB, turned as its display matrix says."""
    rgb = frame.to_ndarray(format="rgb24")
    turns = round((frame.rotation or 0) / 90) % 4  # counter-clockwise quarter turns
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


def open_clip(data: bytes, max_pixels: int, max_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
              ) -> Clip:
    """Open an encoded clip and read its metadata (module docstring); raises ``VideoError``
    (``VideoTooLarge``) with a reason a user can act on."""
    if not data:
        raise VideoError("empty file (0 bytes)", "not_a_video")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, UnicodeDecodeError, ValueError) as e:
        raise VideoError(f"not a readable video ({len(data)} bytes; {e})", "not_a_video") from None
    try:
        return _opened(container, max_pixels, max_seconds)
    except BaseException:
        container.close()
        raise


def _opened(container: av.container.InputContainer, max_pixels: int,
            max_seconds: float) -> Clip:
    if not container.streams.video:
        kinds: list[str] = sorted({str(s.type) for s in container.streams}) or ["none"]
        raise VideoError(f"the file has no video stream (streams: {', '.join(kinds)})",
                         "no_video_stream")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    if ctx is None or ctx.codec is None or not ctx.codec.is_decoder:
        raise VideoError("the clip's codec cannot be decoded by this FFmpeg build",
                         "unsupported_codec")
    w, h = ctx.width, ctx.height
    if w * h > max_pixels:
        raise VideoTooLarge(f"frames are {w}x{h} = {w * h:,} pixels, over the limit of "
                            f"{max_pixels:,} per frame (raise --max-pixels to allow it)",
                            "too_many_pixels")
    index = _demux(container, stream)
    info = _info(stream, index)
    declared = _declared_seconds(container, stream)
    if declared is not None and info.duration < declared - 2 / info.fps:
        raise VideoError(f"the clip declares {declared:.2f} s but its frames end at "
                         f"{info.duration:.2f} s: truncated", "truncated")
    if info.duration > max_seconds:
        raise VideoTooLarge(f"the clip is {info.duration:.1f} s long, over the limit of "
                            f"{max_seconds:g} s (raise --max-video-seconds, or cut it)",
                            "too_long")
    return Clip(container, stream, index, info)


def _demux(container: av.container.InputContainer, stream: av.VideoStream) -> ClipIndex:
    """Every packet's pts and key flag, without decoding (an FFmpeg error: truncated)."""
    pts, keys = [], []
    try:
        for packet in container.demux(stream):
            if packet.pts is None or packet.size == 0:  # the flush packet
                continue
            pts.append(packet.pts)
            if packet.is_keyframe:
                keys.append(packet.pts)
    except av.FFmpegError as e:
        raise VideoError(f"cannot read the clip's packets ({e}): truncated or corrupt",
                         "truncated") from None
    if not pts:
        raise VideoError("the clip's video stream has no frames", "no_frames")
    declared = stream.frames
    if declared and len(pts) < declared:
        raise VideoError(f"the clip declares {declared} frames but holds {len(pts)}: "
                         "truncated", "truncated")
    tb = stream.time_base or Fraction(1, 1)
    return ClipIndex(np.sort(np.asarray(pts, np.int64)), np.sort(np.asarray(keys, np.int64)),
                     Fraction(tb))


def _declared_seconds(container: av.container.InputContainer,
                      stream: av.VideoStream) -> float | None:
    """The video stream's length as the container's header states it: the stream's own, or
    the container's when the video is its only stream (else another may be longer)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        return container.duration / 1_000_000
    return None


def _info(stream: av.VideoStream, index: ClipIndex) -> ClipInfo:
    """Frames, average fps and duration (the last frame's span included)."""
    n = len(index.pts)
    span = float((int(index.pts[-1]) - int(index.pts[0])) * index.time_base)
    rate = stream.average_rate
    fps = float(rate) if rate else (n - 1) / span if n > 1 and span > 0 else 1.0
    return ClipInfo(total_frames=n, fps=fps, duration=span + 1 / fps)
