"""Tile grids equal InternVL's reference ``dynamic_preprocess`` choice.

``reference_grid`` restates the model card's ``find_closest_aspect_ratio`` as the card writes
it (a set of (i, j) ratios sorted by area, closest aspect wins, ties go to the later ratio when
the image covers more than half of its pixels), so a refactor of ``preprocessing.tiling`` that
drifts from the card fails here; ``test_write_up_examples`` pins figures from the write-up
that do not depend on either implementation.
"""

from __future__ import annotations

import numpy as np
import pytest

from vlmbatch.preprocessing.tiling import plan_reference


def reference_grid(w: int, h: int, size: int, lo: int, hi: int) -> tuple[int, int]:
    ratios = set((i, j) for n in range(lo, hi + 1) for i in range(1, n + 1)
                 for j in range(1, n + 1) if lo <= i * j <= hi)
    ratios = sorted(ratios, key=lambda x: x[0] * x[1])
    best_diff, best = float("inf"), (1, 1)
    for r in ratios:
        diff = abs(w / h - r[0] / r[1])
        if diff < best_diff:
            best_diff, best = diff, r
        elif diff == best_diff and w * h > 0.5 * size * size * r[0] * r[1]:
            best = r
    return best


SIZES = [(480, 320), (480, 360), (612, 464), (896, 1344), (1920, 1080), (4000, 3000),
         (64, 64), (100, 2000), (448, 448), (1000, 1000), (300, 900), (1, 1), (5000, 10),
         (449, 224), (800, 600), (2000, 100)]


@pytest.mark.parametrize("w,h", SIZES)
@pytest.mark.parametrize("lo,hi", [(1, 12), (1, 6), (1, 1), (2, 8)])
def test_grid_matches_reference(w: int, h: int, lo: int, hi: int) -> None:
    g = plan_reference(w, h, 448, lo, hi, use_thumbnail=True)
    assert (g.cols, g.rows) == reference_grid(w, h, 448, lo, hi)
    assert g.thumbnail == (g.cols * g.rows != 1)


@pytest.mark.parametrize("w,h,cols,rows,tiles", [
    (612, 464, 4, 3, 13),  # seed 001: 12 tiles + thumbnail = 13 tiles = 3,328 tokens
    (480, 360, 4, 3, 13),
    (896, 1344, 2, 3, 7),  # 2x3 + thumbnail = 7 tiles = 1,792 tokens
    (64, 64, 1, 1, 1),
])
def test_write_up_examples(w: int, h: int, cols: int, rows: int, tiles: int) -> None:
    g = plan_reference(w, h, 448, 1, 12, use_thumbnail=True)
    assert (g.cols, g.rows, g.num_tiles) == (cols, rows, tiles)


def test_rejects_empty_image() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_reference(0, 10, 448, 1, 12, True)


# --- reduced-token mode -------------------------------------------------------------------

from vlmbatch.preprocessing.tiling import fit_scale, plan_reduced  # noqa: E402


@pytest.mark.parametrize("w,h,tiles", [
    (480, 320, 1),  # write-up bar: 512 tokens; 0.93x native fits one 448 tile
    (480, 360, 1),  # reference: 13 tiles
    (612, 464, 2),  # reference: 13 tiles
    (896, 1344, 7),  # 2x3 at native scale + thumbnail, as the reference
    (100, 2000, 6),  # reference upscales 2.7x into 12 tiles; 1x5 keeps 1.1x
    (64, 64, 1),
])
def test_reduced_examples(w: int, h: int, tiles: int) -> None:
    assert plan_reduced(w, h, 448, 1, 12).num_tiles == tiles


@pytest.mark.parametrize("seed", range(5))
def test_reduced_never_worse_than_its_promises(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for w, h in rng.integers(8, 5000, size=(200, 2)):
        w, h = int(w), int(h)
        ref = plan_reference(w, h, 448, 1, 12, True)
        red = plan_reduced(w, h, 448, 1, 12)
        assert red.num_tiles <= ref.num_tiles  # never more tokens than the reference
        s_ref = fit_scale(w, h, 448, ref.cols, ref.rows)
        assert fit_scale(w, h, 448, red.cols, red.rows) >= 0.9 * min(1.0, s_ref) - 1e-9
        assert red.thumbnail == (red.cols * red.rows >= 3) and red.letterbox


def test_letterbox_keeps_aspect_and_pads_with_mean() -> None:
    from vlmbatch.preprocessing.prepare import PAD_RGB, TilingConfig, prepare

    img = np.zeros((60, 200, 3), np.uint8)
    img[:] = (255, 0, 0)
    p = prepare(img, TilingConfig(tile_size=56, max_tiles=6, mode="reduced"))
    g = p.grid
    assert g.letterbox and p.tiles.shape[0] == g.num_tiles
    canvas = p.tiles[: g.cols * g.rows].reshape(g.rows, g.cols, 56, 56, 3)
    canvas = canvas.transpose(0, 2, 1, 3, 4).reshape(g.rows * 56, g.cols * 56, 3)
    red = np.all(canvas == (255, 0, 0), axis=-1)
    ys, xs = np.nonzero(red)
    content_h, content_w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    assert abs(content_w / content_h - 200 / 60) < 0.1  # not stretched
    assert content_h < canvas.shape[0] and np.all(canvas[0] == PAD_RGB)  # padded, centred
    assert np.all(canvas[-1] == PAD_RGB)
