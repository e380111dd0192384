"""Tile planning: which grid of square tiles an image is cut into.

Reference mode reproduces InternVL's ``dynamic_preprocess`` (model card of InternVL2/2.5/3):
candidate grids are every (cols, rows) with ``min_tiles <= cols*rows <= max_tiles``; the one
whose aspect ratio is closest to the image's wins; on a tie the larger grid wins only if the
image has more than half the pixels that grid would need. A thumbnail (the whole image resized
to one tile) is appended when the grid has more than one tile.

Invariants: ``TileGrid.num_tiles == cols * rows + thumbnail`` and the order of tiles is
row-major over the grid, thumbnail last (as InternVL's reference does).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class TileGrid:
    cols: int
    rows: int
    thumbnail: bool

    @property
    def num_tiles(self) -> int:
        return self.cols * self.rows + int(self.thumbnail)


@lru_cache(maxsize=64)
def candidate_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """All (cols, rows) with min_tiles <= cols*rows <= max_tiles, sorted by tile count.

    The sort is stable over a (cols, rows) enumeration, so among equal counts the order is the
    one InternVL's reference iterates in; this matters for its tie-break.
    """
    grids = {
        (c, r)
        for n in range(min_tiles, max_tiles + 1)
        for c in range(1, n + 1)
        for r in range(1, n + 1)
        if min_tiles <= c * r <= max_tiles
    }
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def closest_grid(width: int, height: int, tile: int, min_tiles: int,
                 max_tiles: int) -> tuple[int, int]:
    """The reference choice of (cols, rows) for an image of ``width`` x ``height`` pixels."""
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for cols, rows in candidate_grids(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def plan_reference(width: int, height: int, tile: int, min_tiles: int, max_tiles: int,
                   use_thumbnail: bool) -> TileGrid:
    """InternVL ``dynamic_preprocess`` tiling for one image."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    cols, rows = closest_grid(width, height, tile, min_tiles, max_tiles)
    return TileGrid(cols, rows, thumbnail=use_thumbnail and cols * rows != 1)
