"""Decode, resize policy, tile cutting and content hash."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from vlmbatch.preprocessing.decode import ImageError, decode
from vlmbatch.preprocessing.prepare import TilingConfig, content_hash, cut_tiles, prepare
from vlmbatch.preprocessing.resize import resize
from vlmbatch.preprocessing.tiling import TileGrid


def encode(img: np.ndarray, fmt: str = "PNG", mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    pil = Image.fromarray(img)
    (pil.convert(mode) if mode else pil).save(buf, format=fmt)
    return buf.getvalue()


def rand(h: int, w: int, seed: int = 0, c: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)


@pytest.mark.parametrize("data,msg", [(b"", "empty"), (b"not an image at all", "not a decodable"),
                                      (encode(rand(64, 64))[:60], "not a decodable")])
def test_decode_errors(data: bytes, msg: str) -> None:
    with pytest.raises(ImageError, match=msg):
        decode(data)


def test_resize_policy() -> None:
    img = rand(100, 80)
    assert np.array_equal(resize(img, 40, 50), cv2.resize(img, (40, 50),
                                                          interpolation=cv2.INTER_AREA))
    assert np.array_equal(resize(img, 160, 200), cv2.resize(img, (160, 200),
                                                            interpolation=cv2.INTER_CUBIC))
    # x shrinks, y grows: area on x first, then cubic on y
    two_pass = cv2.resize(cv2.resize(img, (40, 100), interpolation=cv2.INTER_AREA), (40, 200),
                          interpolation=cv2.INTER_CUBIC)
    assert np.array_equal(resize(img, 40, 200), two_pass)
    assert resize(img, 80, 100) is img


def test_cut_tiles_row_major_then_thumbnail() -> None:
    img = rand(90, 200)
    grid = TileGrid(cols=3, rows=2, thumbnail=True)
    tiles = cut_tiles(img, grid, 28)
    big = resize(img, 84, 56)
    assert tiles.shape == (7, 28, 28, 3) and tiles.dtype == np.uint8
    for k in range(6):
        r, c = divmod(k, 3)
        assert np.array_equal(tiles[k], big[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28])
    assert np.array_equal(tiles[6], resize(img, 28, 28))


def test_prepare_counts_and_hash() -> None:
    img = rand(90, 200)
    p = prepare(img, TilingConfig(tile_size=28, max_tiles=6))
    assert p.tiles.shape[0] == p.grid.num_tiles == p.grid.cols * p.grid.rows + 1
    assert (p.width, p.height) == (200, 90)
    # the hash is of pixels, not of the file: PNG and BMP of the same pixels agree
    assert content_hash(decode(encode(img, "BMP"))) == content_hash(decode(encode(img))) \
        == p.content_hash
    other = img.copy()
    other[0, 0, 0] ^= 1
    assert content_hash(other) != p.content_hash
    assert content_hash(img.reshape(200, 90, 3)) != p.content_hash  # shape is hashed too


def test_opencv_refusal_becomes_image_error(monkeypatch) -> None:  # noqa: ANN001
    """cv2.imdecode raises (not returns None) past its own size limits; that must stay an
    item error."""
    def refuse(*_: object) -> None:
        raise cv2.error("OpenCV(5.0) imgcodecs: image size is too big")

    monkeypatch.setattr(cv2, "imdecode", refuse)
    with pytest.raises(ImageError, match="too big"):
        decode(encode(rand(8, 8)))


def photo_like(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus a few hard-edged shapes: JPEG-friendly, with detail at edges."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x / w * 200 + 20, y / h * 180 + 30, (x + y) / (w + h) * 150 + 50], -1)
    img = img.astype(np.uint8)
    for _ in range(12):
        c = tuple(int(v) for v in rng.integers(0, 256, 3))
        cv2.circle(img, (int(rng.integers(0, w)), int(rng.integers(0, h))),
                   int(rng.integers(h // 30, h // 6)), c, -1)
    return img


def jpeg(img: np.ndarray, **kw) -> bytes:  # noqa: ANN003
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=92, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["reference", "reduced"])
# large enough that the tiles need at most half of each side (a 12 MP photo, a panorama)
@pytest.mark.parametrize("size", [(4000, 3000), (5000, 1300)])
def test_dct_reduced_decode_matches_full_decode(mode: str, size: tuple[int, int]) -> None:
    from vlmbatch.preprocessing.prepare import prepare_bytes

    w, h = size
    data = jpeg(photo_like(h, w))
    cfg = TilingConfig(tile_size=448, max_tiles=12, mode=mode, keep_pixels=True)
    fast = prepare_bytes(data, cfg, 10**9)
    full = prepare(decode(data), cfg)
    assert fast.pixels is not None and fast.pixels.shape[0] < h  # the fast path was taken
    assert fast.grid == full.grid and (fast.width, fast.height) == (w, h)
    diff = np.abs(fast.tiles.astype(np.int16) - full.tiles.astype(np.int16))
    # mean abs per tile, grey levels: docs/status.md's "within 0.1 level" (measured 0.069-0.093)
    assert diff.reshape(len(diff), -1).mean(1).max() <= 0.1


def test_dct_reduced_decode_follows_exif_orientation() -> None:
    from vlmbatch.preprocessing.prepare import prepare_bytes

    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated by 90 degrees
    data = jpeg(photo_like(2000, 4000), exif=exif.tobytes())
    cfg = TilingConfig(tile_size=448, max_tiles=12, keep_pixels=True)
    fast, full = prepare_bytes(data, cfg, 10**9), prepare(decode(data), cfg)
    assert fast.pixels.shape[0] > fast.pixels.shape[1]  # portrait, as displayed
    assert (fast.width, fast.height) == (2000, 4000) and fast.grid == full.grid
    assert fast.pixels.shape[0] < 4000  # reduced
    diff = np.abs(fast.tiles.astype(np.int16) - full.tiles.astype(np.int16))
    assert diff.reshape(len(diff), -1).mean(1).max() <= 0.125  # measured 0.117 (docs/status.md)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_no_reduction_when_tiles_need_every_pixel(fmt: str) -> None:
    from vlmbatch.preprocessing.prepare import prepare_bytes

    img = photo_like(500, 700)
    data = jpeg(img) if fmt == "JPEG" else encode(img, "PNG")
    cfg = TilingConfig(tile_size=448, max_tiles=12, keep_pixels=True)
    fast, full = prepare_bytes(data, cfg, 10**9), prepare(decode(data), cfg)
    assert fast.pixels.shape == full.pixels.shape
    assert np.array_equal(fast.tiles, full.tiles) and fast.content_hash == full.content_hash


def test_pixels_are_kept_only_when_asked() -> None:
    img = photo_like(300, 200)
    assert prepare(img, TilingConfig(tile_size=56)).pixels is None  # tiles only: less memory
    kept = prepare(img, TilingConfig(tile_size=56, keep_pixels=True)).pixels
    assert kept is not None and np.array_equal(kept, img)
