"""Decode image bytes to RGB uint8 with OpenCV, with a decompression-bomb guard.

``cv2.imdecode`` with ``IMREAD_COLOR`` gives what the reference (Pillow
``Image.open(f).convert('RGB')``) gives, checked in ``tests/preprocessing/test_decode.py``:
alpha dropped (not composited), gray / gray+alpha / palette expanded, 16-bit scaled to 8, CMYK
JPEG converted (within 1 level), GIF (first frame of an animation), WebP, TIFF, BMP,
progressive JPEG. Truncated files fail in both.

One deliberate difference: the EXIF orientation tag **is applied** (OpenCV's default; equal to
Pillow's ``ImageOps.exif_transpose``). InternVL's reference ignores it, so a phone photo tagged
"rotate 90" reaches its model sideways; we give the model the picture a person sees.

Bomb guard: the pixel count is read from the header (Pillow's lazy ``Image.open``, no pixel
data decoded) and checked against ``max_pixels`` before OpenCV allocates anything. Every
failure raises ``ImageError`` with a message a user can act on; callers turn it into that
item's error and go on.
"""

from __future__ import annotations

import io
import warnings

import cv2
import numpy as np

DEFAULT_MAX_PIXELS = 100_000_000  # 100 MP: a 10000 x 10000 image


class ImageError(ValueError):
    """An image could not be read or decoded; the message names the reason."""


def check_header(data: bytes, max_pixels: int) -> None:
    """Raise ImageError if the header declares more than ``max_pixels``; formats Pillow cannot
    identify pass (their size is checked after decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # Pillow's own bomb warning; our limit decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
    except Image.DecompressionBombError as e:  # over 2x Pillow's limit: size not returned
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        if max_pixels <= limit:
            raise ImageError(f"image is over {limit:,} pixels ({e}), over the limit of "
                             f"{max_pixels:,}") from None
        return
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return
    if w * h > max_pixels:
        raise ImageError(f"image is {w}x{h} = {w * h:,} pixels, over the limit of "
                         f"{max_pixels:,} (raise --max-pixels to allow it)")


def decode(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Bytes of an encoded image -> ``[H, W, 3]`` uint8 RGB, C-contiguous."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    check_header(data, max_pixels)
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    except (cv2.error, MemoryError) as e:  # e.g. over OpenCV's own pixel limit
        raise ImageError(f"cannot decode ({type(e).__name__}: {str(e).strip()[:200]})") from None
    if bgr is None:
        raise ImageError(f"not a decodable image ({len(data)} bytes; truncated or unknown format)")
    if bgr.shape[0] * bgr.shape[1] > max_pixels:  # formats whose header Pillow cannot read
        raise ImageError(f"image is {bgr.shape[1]}x{bgr.shape[0]} pixels, over the limit of "
                         f"{max_pixels:,} (raise --max-pixels to allow it)")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=bgr)  # in place: no second full-size copy
