"""The records of an item's visual parts beyond one still image: a sampled clip, and an item
holding several parts (images and clips, in prompt order).

Contract between the preprocessing layer (which decodes and samples a clip and lays its
frames out as its family's vision rows) and the engine and models (which encode the rows,
cache features per frame group and build the prompt). Written first so both sides build
against one record; ``PreparedImage`` (``prepare.py``) stays the still image's record.

Invariants:
- ``rows`` follow the family's vision input, uint8, as ``PreparedImage.rows`` does: Qwen-VL
  patch rows ``[t * h * w, C * T * P * P]`` (transformers' ``pixel_values_videos`` layout
  before normalisation, ``T`` = the temporal patch size, 2), InternVL one ``[S, S, 3]`` tile
  per frame ``[F, S, S, 3]``.
- A *frame group* is what the vision tower encodes alone: Qwen-VL's ``T`` consecutive sampled
  frames (one temporal patch), InternVL's one frame. ``group_hashes[i]`` hashes group ``i``'s
  pixels and shape, so a group's features are cached and reused exactly, across windows,
  items and requests; ``content_hash`` hashes the groups in order (the prefix cache's key).
- ``seconds[k]`` is the time in the source clip of sampled frame ``k``; ``fps`` is the
  sampling rate the family's positions or time texts use (Qwen2.5-VL's
  ``second_per_grid_ts = T / fps``), never a silently assumed default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:  # types only: prepare.py loads OpenCV, which light modules must not
    from vlmbatch.preprocessing.prepare import ImageGrid, PreparedImage


@dataclass(frozen=True, eq=False)
class PreparedVideo:
    """One sampled clip ready for its family's vision module (module docstring)."""
    rows: np.ndarray  # uint8: Qwen-VL [t*h*w, C*T*P*P]; InternVL [F, S, S, 3]
    grid: ImageGrid  # Qwen-VL: dims (t, h, w) in patches (video_grid_thw); InternVL: frames
    group_hashes: tuple[str, ...]  # one per frame group (Qwen-VL: T frames; InternVL: 1)
    content_hash: str  # of all groups in order
    seconds: tuple[float, ...]  # source time of each sampled frame
    frame_indices: tuple[int, ...]  # source frame number of each sampled frame
    fps: float  # the sampling rate the family's time positions / texts are computed from
    width: int  # of the source frames (display orientation applied)
    height: int

    @property
    def cache_key(self) -> str:
        """Identifies the clip's tokens: same frames *and* same layout."""
        return f"video:{self.content_hash}:{self.grid.key}@{self.rows.shape[1]}"


# An item's visual parts in prompt order: one image (today's items), several images, a clip.
MediaPart: TypeAlias = "PreparedImage | PreparedVideo"


@dataclass(frozen=True, eq=False)
class WindowedClip:
    """A clip prepared window by window (``video_windows.py``): ``videos[k]`` is window
    ``k``'s sampled clip, ``windows[k]`` its ``(start, end)`` seconds (to the millisecond).
    Frames two windows share hash alike, so their groups are encoded once."""
    videos: tuple[PreparedVideo, ...]
    windows: tuple[tuple[float, float], ...]
