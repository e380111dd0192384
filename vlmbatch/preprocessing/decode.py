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
from PIL import Image, UnidentifiedImageError

from vlmbatch.preprocessing.limits import DEFAULT_MAX_PIXELS

# Pillow's own decompression-bomb warning: our max_pixels decides. Set once, here, because
# warnings.catch_warnings() is not thread-safe and headers are checked in preprocessing
# threads (pipeline.drive.prepared_groups).
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class ImageError(ValueError):
    """An image could not be read or decoded; the message names the reason."""


class ImageTooLarge(ImageError):
    """The image has more pixels than the run's limit (``--max-pixels``): the bomb guard."""


def check_header(data: bytes, max_pixels: int) -> tuple[int, int, str] | None:
    """Raise ImageError if the header declares more than ``max_pixels``; formats Pillow cannot
    identify pass (their size is checked after decoding). Returns (width, height, format),
    for a JPEG after the EXIF orientation OpenCV applies (tags 5-8 swap the axes), or None
    when the header could not be read."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            fmt = im.format or ""
            if fmt == "JPEG" and _exif_orientation(im) in (5, 6, 7, 8):
                w, h = h, w
    except Image.DecompressionBombError as e:  # over 2x Pillow's limit: size not returned
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        if max_pixels <= limit:
            raise ImageTooLarge(f"image is over {limit:,} pixels ({e}), over the limit of "
                                f"{max_pixels:,}") from None
        return None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    if w * h > max_pixels:
        raise ImageTooLarge(f"image is {w}x{h} = {w * h:,} pixels, over the limit of "
                            f"{max_pixels:,} (raise --max-pixels to allow it)")
    return w, h, fmt


# libjpeg decodes at 1/2, 1/4, 1/8 scale in the DCT domain, skipping most of the work.
_REDUCED = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_COLOR_8}


def decode(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, reduce: int = 1) -> np.ndarray:
    """Bytes of an encoded image -> ``[H, W, 3]`` uint8 RGB, C-contiguous.

    ``reduce`` (1, 2, 4, 8): for JPEG, decode at that fraction of each side (DCT scaling, the
    size rounded up); other formats ignore it. ``decode_for`` chooses it.
    """
    if not data:
        raise ImageError("empty file (0 bytes)")
    check_header(data, max_pixels)
    return _imdecode(data, max_pixels, reduce)


def _imdecode(data: bytes, max_pixels: int, reduce: int) -> np.ndarray:
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        bgr = cv2.imdecode(buf, _REDUCED[reduce])
    except (cv2.error, MemoryError) as e:  # e.g. over OpenCV's own pixel limit
        raise ImageError(f"cannot decode ({type(e).__name__}: {str(e).strip()[:200]})") from None
    if bgr is None:
        raise ImageError(f"not a decodable image ({len(data)} bytes; truncated or unknown format)")
    if bgr.shape[0] * bgr.shape[1] > max_pixels:  # formats whose header Pillow cannot read
        raise ImageTooLarge(f"image is {bgr.shape[1]}x{bgr.shape[0]} pixels, over the limit "
                            f"of {max_pixels:,} (raise --max-pixels to allow it)")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=bgr)  # in place: no second full-size copy


def decode_for(data: bytes, need, max_pixels: int = DEFAULT_MAX_PIXELS,  # noqa: ANN001
               ) -> tuple[np.ndarray, tuple[int, int] | None]:
    """Decode for a consumer that needs at most ``need(width, height) -> (width, height)``
    pixels of an image of the given (EXIF-oriented) size.

    A JPEG is decoded at the largest DCT reduction (2, 4, 8) that still leaves at least the
    needed pixels on both axes; everything else at full size. Returns (pixels, (width, height)
    of the full oriented image when the pixels are reduced, else None: plan on the pixels).
    """
    if not data:
        raise ImageError("empty file (0 bytes)")
    header = check_header(data, max_pixels)
    reduce = 1
    full = None
    if header is not None and header[2] == "JPEG":
        w, h = header[:2]
        nw, nh = need(w, h)
        while reduce < 8 and w // (2 * reduce) >= nw and h // (2 * reduce) >= nh:
            reduce *= 2
        full = (w, h)
    img = _imdecode(data, max_pixels, reduce)
    if reduce == 1:
        return img, None
    assert full is not None  # set wherever reduce > 1
    ih, iw = img.shape[:2]
    if abs(iw - -(-full[0] // reduce)) > 1 or abs(ih - -(-full[1] // reduce)) > 1:
        return _imdecode(data, max_pixels, 1), None  # orientation not as read: play safe
    return img, full


def _exif_orientation(im) -> int:  # noqa: ANN001
    try:
        return int(im.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001  (a broken EXIF block: OpenCV ignores it too)
        return 1
