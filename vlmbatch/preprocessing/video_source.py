"""``VideoSource``: a clip sent to a decoder process (``isolated.py``), apart from the plan's
modules so that a decoder process imports PyAV (~130 ms, ~17 MB) only when its first clip
arrives (unpickling the plan imports ``video_plan.py``), never for images alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmbatch.preprocessing.video_plan import VideoPlan


@dataclass(frozen=True)
class VideoSource:
    """A clip to prepare in a decoder process (``DecoderPool.submit``): where its bytes are
    (a path or URL the worker reads, or the bytes) and its plan (sampling keys included)."""
    source: str | bytes
    plan: VideoPlan
