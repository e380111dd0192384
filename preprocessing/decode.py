"""Decode image bytes to RGB uint8 with OpenCV.

``cv2.imdecode`` with ``IMREAD_COLOR`` applies the EXIF orientation, drops alpha, expands gray
and palette images to three channels and scales 16-bit samples to 8 bits, which is what the
reference (Pillow ``Image.open(...).convert('RGB')``) gives for the common cases. Issue 3 makes
the odd formats (CMYK, animated, truncated) exact and adds the decompression-bomb guard.

Every failure raises ``ImageError`` with a message a user can act on; callers turn it into
that item's error and go on.
"""

from __future__ import annotations

import cv2
import numpy as np


class ImageError(ValueError):
    """An image could not be read or decoded; the message names the reason."""


def decode(data: bytes) -> np.ndarray:
    """Bytes of an encoded image -> ``[H, W, 3]`` uint8 RGB, C-contiguous."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    except (cv2.error, MemoryError) as e:  # e.g. over OpenCV's own pixel limit
        raise ImageError(f"cannot decode ({type(e).__name__}: {str(e).strip()[:200]})") from None
    if bgr is None:
        raise ImageError(f"not a decodable image ({len(data)} bytes; truncated or unknown format)")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
