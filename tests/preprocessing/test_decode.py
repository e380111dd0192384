"""Decode parity with the reference (Pillow ``convert('RGB')``), EXIF policy, bomb guard."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from vlmbatch.preprocessing.decode import ImageError, decode


def smooth(h: int = 40, w: int = 60, seed: int = 0) -> np.ndarray:
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)
    return cv2.GaussianBlur(img, (7, 7), 3)  # JPEG-friendly


def save(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def reference(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def png16(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", cv2.cvtColor(img.astype(np.uint16) * 257, cv2.COLOR_RGB2BGR))
    assert ok
    return buf.tobytes()


CASES = {  # name -> (bytes maker, max abs difference allowed)
    "rgb_png": (lambda im: save(im, "PNG"), 0),
    "rgba_png": (lambda im: save(im.convert("RGBA"), "PNG"), 0),
    "gray_png": (lambda im: save(im.convert("L"), "PNG"), 0),
    "gray_alpha_png": (lambda im: save(im.convert("LA"), "PNG"), 0),
    "palette_png": (lambda im: save(im.convert("P"), "PNG"), 0),
    "png_16bit": (lambda im: png16(np.asarray(im)), 0),
    "gif": (lambda im: save(im.convert("P"), "GIF"), 0),
    "webp_lossless": (lambda im: save(im, "WEBP", lossless=True), 0),
    "tiff": (lambda im: save(im, "TIFF"), 0),
    "bmp": (lambda im: save(im, "BMP"), 0),
    "jpeg_progressive": (lambda im: save(im, "JPEG", quality=90, progressive=True), 0),
    "jpeg_cmyk": (lambda im: save(im.convert("CMYK"), "JPEG", quality=95), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_pillow_convert_rgb(name: str) -> None:
    make, tol = CASES[name]
    data = make(Image.fromarray(smooth()))
    got, want = decode(data), reference(data)
    assert got.shape == want.shape and got.dtype == np.uint8
    assert np.abs(got.astype(int) - want.astype(int)).max() <= tol


def test_animated_gif_first_frame() -> None:
    a = smooth()
    frames = [Image.fromarray(a), Image.fromarray(255 - a)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert np.array_equal(decode(buf.getvalue()), reference(buf.getvalue()))


def test_exif_orientation_is_applied() -> None:
    """Documented difference: the reference ignores EXIF; we rotate like exif_transpose."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = save(Image.fromarray(smooth()), "JPEG", quality=95, exif=exif.tobytes())
    got = decode(data)
    assert reference(data).shape == (40, 60, 3)  # reference: as stored
    shown = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert got.shape == shown.shape == (60, 40, 3)
    assert np.abs(got.astype(int) - shown.astype(int)).max() <= 1


def test_truncated_jpeg_fails_like_the_reference() -> None:
    data = save(Image.fromarray(smooth()), "JPEG", quality=90)
    with pytest.raises(OSError):
        reference(data[: len(data) // 2])
    with pytest.raises(ImageError, match="truncated"):
        decode(data[: len(data) // 2])


def test_pixel_limit_from_header_before_decoding() -> None:
    huge = save(Image.new("1", (12_000, 10_000)), "PNG")  # 120 MP, a few KB of file
    assert len(huge) < 200_000
    with pytest.raises(ImageError, match="12000x10000 = 120,000,000 pixels, over the limit"):
        decode(huge)
    small = save(Image.fromarray(smooth()), "PNG")
    with pytest.raises(ImageError, match="--max-pixels"):
        decode(small, max_pixels=1000)
    assert decode(small, max_pixels=2400).shape == (40, 60, 3)


def test_pixel_limit_beyond_pillows_own_bomb_limit() -> None:
    """Past 2x Pillow's limit its header read raises instead of returning the size."""
    huge = save(Image.new("1", (20_000, 10_000)), "PNG")  # 200 MP
    with pytest.raises(ImageError, match="over the limit"):
        decode(huge)
