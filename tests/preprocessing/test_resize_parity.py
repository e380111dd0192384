"""Resize policy vs the write-up's ripple artefact, and parity with the Pillow reference."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from PIL import Image

from vlmbatch.preprocessing.prepare import TilingConfig, prepare
from vlmbatch.preprocessing.reference import pillow_tiles
from vlmbatch.preprocessing.resize import resize


def zone_plate(n: int = 512) -> np.ndarray:
    """Concentric rings whose frequency rises to Nyquist at the edge: aliasing shows as
    ripples (moire) wherever a downscale keeps frequencies it cannot represent."""
    y, x = np.mgrid[-1:1:complex(n), -1:1:complex(n)]
    img = 127.5 + 127.5 * np.cos(np.pi * n / 2 * (x * x + y * y))
    return np.repeat(img[..., None], 3, axis=2).astype(np.uint8)


def test_cubic_downscale_ripples_and_the_policy_avoids_them() -> None:
    """Downscaling 4x, the outer rings are above the new Nyquist: a correct filter turns them
    into flat gray. OpenCV's INTER_CUBIC keeps false rings there (the write-up's ripples)."""
    img = zone_plate()
    cubic = cv2.resize(img, (128, 128), interpolation=cv2.INTER_CUBIC).astype(float)
    ours = resize(img, 128, 128).astype(float)
    pil = np.asarray(Image.fromarray(img).resize((128, 128), Image.Resampling.BICUBIC), float)
    r = np.hypot(*np.mgrid[-1:1:128j, -1:1:128j])
    band = (r > 0.3) & (r < 0.7)  # rings above the new Nyquist, below the source's own
    assert cubic[band].std() > 30  # strong false ripples
    assert ours[band].std() < 15 and pil[band].std() < 15  # the policy and Pillow: near flat
    assert ours[band].std() < cubic[band].std() / 3


def smooth_photo(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)


@pytest.mark.parametrize("w,h", [(480, 360), (612, 464), (1024, 768), (300, 900), (200, 150)])
def test_tiles_close_to_pillow_reference(w: int, h: int) -> None:
    """Same grid, same order; mean absolute difference per tile <= 2 levels (of 255)."""
    img = smooth_photo(h, w, seed=w)
    ok, png = cv2.imencode(".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    assert ok
    ours = prepare(img, TilingConfig(tile_size=448, max_tiles=12)).tiles
    ref = np.stack([np.asarray(t) for t in pillow_tiles(png.tobytes(), 448, 1, 12)])
    assert ours.shape == ref.shape
    mad = np.abs(ours.astype(float) - ref.astype(float)).mean(axis=(1, 2, 3))
    assert mad.max() <= 2.0, mad
