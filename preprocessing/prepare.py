"""From decoded pixels to model-ready uint8 tiles: the record the vision encoder consumes.

Tiles stay uint8 ``[N, S, S, 3]``; normalisation happens inside the vision encoder, on its
device. The content hash covers the decoded pixels and their shape, so two images with equal
pixels share a hash whatever their file format; the prefix cache (issue 5) keys on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from preprocessing.resize import resize
from preprocessing.tiling import TileGrid, plan_reference


@dataclass(frozen=True)
class TilingConfig:
    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True

    def __post_init__(self) -> None:
        if self.tile_size <= 0 or not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"bad tiling config {self}: need tile_size > 0 and "
                             "1 <= min_tiles <= max_tiles")


@dataclass(frozen=True, eq=False)
class PreparedImage:
    tiles: np.ndarray  # [N, S, S, 3] uint8 RGB, grid tiles row-major then thumbnail
    grid: TileGrid
    content_hash: str  # xxh3-128 hex of the decoded pixels and their shape
    width: int  # of the decoded image
    height: int
    pixels: np.ndarray | None = None  # the decoded [H, W, 3] image, for engines that re-tile

    @property
    def cache_key(self) -> str:
        """Identifies the image tokens: same pixels *and* same tiling (grid, tile size)."""
        g = self.grid
        thumb = "+t" if g.thumbnail else ""
        return f"{self.content_hash}:{g.cols}x{g.rows}{thumb}@{self.tiles.shape[1]}"


def content_hash(img: np.ndarray) -> str:
    h = xxhash.xxh3_128()
    h.update(np.asarray(img.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(img).data)
    return h.hexdigest()


def cut_tiles(img: np.ndarray, grid: TileGrid, tile: int) -> np.ndarray:
    """Resize ``img`` [H, W, 3] to the grid and cut it; one copy beyond the resizes."""
    resized = resize(img, grid.cols * tile, grid.rows * tile)
    n = grid.num_tiles
    out = np.empty((n, tile, tile, 3), dtype=np.uint8)
    # [rows*S, cols*S, 3] -> [rows, S, cols, S, 3] -> [rows, cols, S, S, 3]
    view = resized.reshape(grid.rows, tile, grid.cols, tile, 3).transpose(0, 2, 1, 3, 4)
    out[: grid.cols * grid.rows] = view.reshape(-1, tile, tile, 3)
    if grid.thumbnail:
        out[-1] = resize(img, tile, tile)
    return out


def prepare(img: np.ndarray, cfg: TilingConfig) -> PreparedImage:
    """Decoded ``[H, W, 3]`` uint8 RGB -> tiles in InternVL reference tiling."""
    h, w = img.shape[:2]
    grid = plan_reference(w, h, cfg.tile_size, cfg.min_tiles, cfg.max_tiles, cfg.use_thumbnail)
    return PreparedImage(cut_tiles(img, grid, cfg.tile_size), grid, content_hash(img), w, h,
                         pixels=img)
