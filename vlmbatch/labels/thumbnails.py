"""The small pictures ``vlmbatch report`` embeds (``report.py``): an image shrunk, the images
of a list (``"images": [...]``) each shrunk, a clip as a strip of a few of its frames.

Each picture is a JPEG ``data:`` URL (the page loads nothing), ``size`` pixels on its longer
side (Pillow's ``thumbnail``: aspect kept), or None where the source cannot be read (the page
says so). Only what is shown is read again: a list's first ``LIST_SHOWN`` images; a clip's
``STRIP`` frames, decoded as sampled (``preprocessing/video.py``: seek, not decode-all), each
shrunk as soon as it is decoded.

Which frames a strip shows: ``STRIP`` of the frames the model saw (the result line's
``seconds``), spread evenly over them, first and last included; a clip whose answer failed
(no ``seconds``) shows the middles of ``STRIP`` equal segments of the clip, as InternVL
samples. A second maps to the frame presented nearest to it.

Light: PyAV (and the decoder module's OpenCV) are imported only when a clip is drawn, so a
report on a job without clips, and ``calibrate``, import neither (``tests/cli/
test_video_labels.py``).
"""

from __future__ import annotations

import base64
import bisect
import importlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image, ImageOps

from vlmbatch.pipeline.media_inputs import ImageList, VideoInput
from vlmbatch.preprocessing.sources import SourceError, read_bytes

STRIP = 4  # frames shown of a clip
LIST_SHOWN = 6  # images shown of a list (the rest counted)
MAX_FRAME_PIXELS = 2**31  # a clip too large for the run is still drawn: 4 frames


@dataclass(frozen=True)
class Picture:
    """One picture of an item: its ``data:`` URL (None: unreadable) and what it shows
    ("image 2", "1.20 s")."""
    url: str | None
    title: str


def _jpeg(im: Image.Image, size: int) -> str:
    """``im`` (RGB) shrunk to ``size`` on its longer side, as a JPEG ``data:`` URL."""
    im.thumbnail((size, size))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def thumbnail(image: str, base_dir: Path, size: int = 128) -> str | None:
    """A JPEG ``data:`` URL of the image shrunk to ``size`` pixels on its longer side (EXIF
    orientation applied); None when it cannot be read (the page says so)."""
    try:
        data = read_bytes(image, base_dir)
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (size, size))  # a JPEG decodes at 1/2..1/8 scale when it can
            small = ImageOps.exif_transpose(im).convert("RGB")
        return _jpeg(small, size)
    except (SourceError, OSError, ValueError, Image.DecompressionBombError):
        return None


def list_pictures(images: ImageList, base_dir: Path, size: int) -> tuple[list[Picture], int]:
    """(the first ``LIST_SHOWN`` images of the list, in order; how many more it holds). An
    image that is not a path or URL (a table's row, pixels from the API) is unreadable."""
    shown = [Picture(thumbnail(s, base_dir, size) if isinstance(s, str) else None,
                     f"image {k + 1}") for k, s in enumerate(images.images[:LIST_SHOWN])]
    return shown, max(len(images.images) - LIST_SHOWN, 0)


def strip_indices(frame_seconds: Sequence[float], seen: Sequence[float] | None,
                  count: int = STRIP) -> list[int]:
    """The frame numbers a strip shows (module docstring): ``count`` of the ``seen`` seconds
    spread evenly (first and last included), each mapped to the frame whose time in
    ``frame_seconds`` (ascending, each frame's presentation time) is nearest; without
    ``seen``, the middles of ``count`` equal segments of the clip. Ascending, no repeats."""
    total = len(frame_seconds)
    if not seen:
        n = min(count, total)
        return sorted({int((2 * k + 1) * total / (2 * n)) for k in range(n)})
    n = min(count, len(seen))
    picked = [seen[round(k * (len(seen) - 1) / (n - 1))] if n > 1 else seen[0]
              for k in range(n)]
    out = set()
    for s in picked:
        i = bisect.bisect_left(frame_seconds, s)
        near = [j for j in (i - 1, i) if 0 <= j < total]
        out.add(min(near, key=lambda j: (abs(frame_seconds[j] - s), j)))
    return sorted(out)


def _decoder() -> ModuleType:
    """``preprocessing/video.py``, imported on first use: it loads PyAV and (through
    ``decode.py``) OpenCV, which a report without clips never needs (as ``resize.py``'s
    ``kernel_of`` imports a kernel's module)."""
    return importlib.import_module("vlmbatch.preprocessing.video")


def clip_pictures(source: str | bytes, base_dir: Path, size: int,
                  seen: Sequence[float] | None = None) -> list[Picture]:
    """The strip of a clip (``strip_indices``), each frame upright and shrunk; [] when the
    clip cannot be read or decoded."""
    video = _decoder()

    def fit(rgb: np.ndarray) -> np.ndarray:
        small = Image.fromarray(rgb)
        small.thumbnail((size, size))
        return np.asarray(small)

    try:
        data = source if isinstance(source, bytes) else read_bytes(source, base_dir)
        with video.open_clip(data, MAX_FRAME_PIXELS, float("inf")) as clip:
            times = [clip.index.seconds(k) for k in range(len(clip.index.pts))]
            idx = strip_indices(times, seen)
            got = clip.frames(np.array(idx), fit)
    except (SourceError, video.VideoError, OSError, ValueError):
        return []
    return [Picture(_jpeg(Image.fromarray(px), size), f"{s:.2f} s")
            for px, s in zip(got.pixels, got.seconds)]


def item_pictures(media: object, base_dir: Path, size: int,
                  seen: Sequence[float] | None = None) -> tuple[list[Picture], int] | None:
    """An item's pictures when it is a list (its images) or a clip (its strip), with how
    many images of a list are not shown; None for a single image (``thumbnail``)."""
    if isinstance(media, ImageList):
        return list_pictures(media, base_dir, size)
    if isinstance(media, VideoInput):
        return clip_pictures(media.source, base_dir, size, seen), 0
    return None
