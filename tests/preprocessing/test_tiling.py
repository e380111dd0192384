"""Tile grids equal InternVL's reference ``dynamic_preprocess`` choice.

``reference_grid`` restates the model card's ``find_closest_aspect_ratio`` as the card writes
it (a set of (i, j) ratios sorted by area, closest aspect wins, ties go to the later ratio when
the image covers more than half of its pixels), so a refactor of ``preprocessing.tiling`` that
drifts from the card fails here; ``test_write_up_examples`` pins figures from the write-up
that do not depend on either implementation.
"""

from __future__ import annotations

import pytest

from preprocessing.tiling import plan_reference


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
