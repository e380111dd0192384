"""Tile planning: which grid of square tiles an image is cut into.

Reference mode reproduces InternVL's ``dynamic_preprocess`` (model card of InternVL2/2.5/3):
candidate grids are every (cols, rows) with ``min_tiles <= cols*rows <= max_tiles``; the one
whose aspect ratio is closest to the image's wins; on a tie the larger grid wins only if the
image has more than half the pixels that grid would need. A thumbnail (the whole image resized
to one tile) is appended when the grid has more than one tile.

Reduced-token mode (the default) keeps what the image holds and no more:

- the grid is the one with the *fewest* tiles whose letterboxed fit scale
  ``s = min(cols*S/w, rows*S/h)`` reaches ``slack * min(upscale_limit, s_ref)``, where
  ``s_ref`` is the scale the reference grid gives along its tighter axis: never more tiles
  than the image's own pixels justify (``upscale_limit``, 1.0 = native resolution), never
  less resolution than the reference keeps (less ``slack``, 0.9: a 10% downscale is allowed
  to save a tile), and never more tiles than the reference uses; ties go to the larger ``s``;
- the image keeps its aspect ratio: it is scaled by ``s`` and centred on the grid's canvas,
  the rest padded with the normalisation mean (``letterbox``), instead of being stretched;
- a thumbnail is added only for grids of 3 or more tiles, where the tiles cut objects apart
  and a whole-image view adds layout the tiles do not show; at 1-2 tiles it would repeat the
  grid's content at lower resolution.

Invariants: ``TileGrid.num_tiles == cols * rows + thumbnail`` and the order of tiles is
row-major over the grid, thumbnail last (as InternVL's reference does).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# the two planners below ("reduced": plan_reduced, "reference": plan_reference); a light
# module, so the configs and the CLI name the modes without importing the decoder
TILING_MODES = ("reduced", "reference")
# --resize: "opencv" (our policy) | "reference" (the family's transformers processor's pixels)
# | "pillow" (Pillow's bicubic, transformers' pil-backend processors: what it gives without
# torchvision); the kernels are in resize.py, named here for the same light configs
RESIZE_MODES = ("opencv", "reference", "pillow")


@dataclass(frozen=True)
class TileGrid:
    cols: int
    rows: int
    thumbnail: bool
    letterbox: bool = False  # aspect kept, padded; False: stretched to the grid (reference)

    @property
    def num_tiles(self) -> int:
        return self.cols * self.rows + int(self.thumbnail)

    @property
    def key(self) -> str:
        """``ImageGrid.key``: e.g. ``3x2+tL`` (thumbnail, letterboxed)."""
        return f"{self.cols}x{self.rows}{'+t' if self.thumbnail else ''}" \
               f"{'L' if self.letterbox else ''}"

    @property
    def dims(self) -> tuple[int, ...]:
        """``ImageGrid.dims``: tiles need nothing beside their pixels."""
        return ()


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


def fit_scale(width: int, height: int, tile: int, cols: int, rows: int) -> float:
    """Scale that fits the image inside a cols x rows grid without stretching."""
    return min(cols * tile / width, rows * tile / height)


def plan_reduced(width: int, height: int, tile: int, min_tiles: int, max_tiles: int,
                 upscale_limit: float = 1.0, slack: float = 0.9,
                 thumbnail_from: int = 3) -> TileGrid:
    """Reduced-token tiling (module docstring): fewest tiles that keep the needed scale."""
    ref = plan_reference(width, height, tile, min_tiles, max_tiles, use_thumbnail=False)
    s_ref = fit_scale(width, height, tile, ref.cols, ref.rows)
    target = slack * min(upscale_limit, s_ref)
    best: tuple[int, float, int, int] | None = None  # (tiles, -scale, cols, rows)
    for cols, rows in candidate_grids(min_tiles, ref.cols * ref.rows):
        s = fit_scale(width, height, tile, cols, rows)
        if s >= target:
            key = (cols * rows, -s, cols, rows)
            best = key if best is None or key < best else best
    cols, rows = (best[2], best[3]) if best else (ref.cols, ref.rows)
    return TileGrid(cols, rows, thumbnail=cols * rows >= thumbnail_from, letterbox=True)
