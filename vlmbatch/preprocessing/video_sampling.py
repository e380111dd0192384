"""Which frames of a clip each family's model sees: transformers' video processors' own rules.

Given a clip's metadata (``ClipInfo``: frames, source fps), ``VideoSampling.indices`` returns
the source frame numbers transformers 5's video processor of the family samples, for the same
``fps`` / ``num_frames`` / ``min_frames`` / ``max_frames`` (tested against the processors'
``sample_frames`` on many clips, ``tests/preprocessing/test_video_sampling.py``):

- ``qwen2_vl`` (Qwen2-VL, Qwen2.5-VL; ``Qwen2VLVideoProcessor.sample_frames``): with
  ``num_frames`` it is rounded to a multiple of the temporal patch ``T`` (2); with ``fps``,
  ``total / src_fps * fps`` bounded by ``min_frames`` and ``max_frames`` (itself floored to a
  multiple of ``T`` and to the clip) and floored to a multiple of ``T``; then
  ``arange(0, total, total / n)`` in float32 as torch computes it, truncated;
- ``qwen3_vl`` (Qwen3-VL, Qwen3.5; ``Qwen3VLVideoProcessor.sample_frames``): with ``fps``,
  ``int(total / src_fps * fps)`` bounded by ``min_frames``, ``max_frames`` and the clip;
  then ``linspace(0, total - 1, n)`` rounded;
- ``internvl`` (``InternVLVideoProcessor.sample_frames``, the model card's ``get_index``):
  one frame per equal segment, from its middle (``initial_shift``):
  ``arange(total / n / 2, total, total / n)`` in float32, truncated.

``num_frames`` and ``fps`` are exclusive, as in transformers; a setting that would sample more
frames than the clip has raises ``ValueError`` there and ``SamplingError`` here (an item's
error: the clip is too short for what was asked). Light: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FAMILIES = ("qwen2_vl", "qwen3_vl", "internvl")


class SamplingError(ValueError):
    """The clip cannot be sampled as asked (fewer frames than ``num_frames``, say)."""


@dataclass(frozen=True)
class ClipInfo:
    """A clip's metadata as the sampling reads it (transformers' ``VideoMetadata``)."""
    total_frames: int
    fps: float  # the source's average frame rate (frames / duration)
    duration: float  # seconds

    def __post_init__(self) -> None:
        if self.total_frames < 1 or not self.fps > 0:
            raise SamplingError(f"a clip needs >= 1 frame and fps > 0, got {self}")


@dataclass(frozen=True)
class VideoSampling:
    """How a family samples a clip (module docstring). ``num_frames`` set: that many frames
    whatever the clip's length; else ``fps`` frames per second of the clip."""
    family: str
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    temporal: int = 2  # Qwen-VL's temporal patch: frames the tower encodes together

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"video sampling family {self.family!r} is not one of {FAMILIES}")
        if (self.fps is None) == (self.num_frames is None):
            raise ValueError(f"give exactly one of fps and num_frames, got {self}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        if not 1 <= self.min_frames <= self.max_frames or self.temporal < 1:
            raise ValueError(f"need 1 <= min_frames <= max_frames and temporal >= 1: {self}")

    def indices(self, clip: ClipInfo) -> np.ndarray:
        """Source frame numbers to decode, ascending, int64 (module docstring)."""
        if self.family == "qwen2_vl":
            return _qwen2_vl(self, clip)
        if self.family == "qwen3_vl":
            return _qwen3_vl(self, clip)
        return _internvl(self, clip)


def torch_arange_int(start: float, stop: float, step: float) -> np.ndarray:
    """``torch.arange(start, stop, step).int()`` for a float ``step`` on the CPU, bit for bit.

    torch's kernel (``RangeFactoriesKernel.cpp``) fills float32 in pairs of 8-lane vectors:
    each vector's first value ``start + step * i0`` in double rounded to float32, the lanes
    that value plus ``j * step`` (in double) rounded again; the last ``n % 16`` values one by
    one, ``start + step * i`` in double then float32. Then ``.int()`` truncates. The same
    on this machine's AVX512, AVX2 and default kernels (checked); past 32768 values torch
    splits the work across threads, which this does not follow (no sampling asks that many).
    """
    n = max(math.ceil((stop - start) / step), 0)
    i = np.arange(n, dtype=np.int64)
    out = (start + i * step).astype(np.float32)
    vec = n // 16 * 16
    base = i[:vec] // 8 * 8
    first = (start + base * step).astype(np.float32).astype(np.float64)
    out[:vec] = (first + (i[:vec] - base) * step).astype(np.float32)
    return out.astype(np.int64)


def _qwen2_vl(s: VideoSampling, clip: ClipInfo) -> np.ndarray:
    total, t = clip.total_frames, s.temporal
    if s.num_frames is not None:
        n: float = round(s.num_frames / t) * t
    else:
        assert s.fps is not None  # one of the two (__post_init__)
        max_frames = math.floor(min(s.max_frames, total) / t) * t
        n = min(max(total / clip.fps * s.fps, s.min_frames), max_frames, total)
        n = math.floor(n / t) * t
    if n > total:
        raise SamplingError(f"the clip has {total} frames, fewer than the {n:g} asked "
                            "(lower num_frames or fps)")
    if n <= 0:
        raise SamplingError(f"the clip has {total} frames, fewer than one temporal patch of "
                            f"{t} frames: too short for this model")
    return torch_arange_int(0, total, total / n)


def _qwen3_vl(s: VideoSampling, clip: ClipInfo) -> np.ndarray:
    total = clip.total_frames
    if s.num_frames is not None:
        n = s.num_frames
    else:
        assert s.fps is not None
        n = min(max(int(total / clip.fps * s.fps), s.min_frames), s.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def _internvl(s: VideoSampling, clip: ClipInfo) -> np.ndarray:
    total = clip.total_frames
    if s.num_frames is not None:
        n = s.num_frames
    else:
        assert s.fps is not None
        n = int(total / clip.fps * s.fps)
    if n > total:
        raise SamplingError(f"the clip has {total} frames, fewer than the {n} asked "
                            "(lower num_frames or fps)")
    if n <= 0:
        raise SamplingError(f"the clip ({total} frames at {clip.fps:g} fps) gives no frame at "
                            f"{s.fps:g} fps: raise fps or give num_frames")
    return torch_arange_int(total / n / 2, total, total / n)
