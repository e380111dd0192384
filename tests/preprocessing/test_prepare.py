"""Decode, resize policy, tile cutting and content hash."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from preprocessing.decode import ImageError, decode
from preprocessing.prepare import TilingConfig, content_hash, cut_tiles, prepare
from preprocessing.resize import resize
from preprocessing.tiling import TileGrid


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
