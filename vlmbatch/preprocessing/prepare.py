"""From decoded pixels to model-ready uint8 rows: the record the vision encoder consumes.

``PreparedImage`` is the one image record of every family. The engine reads it only through
``rows`` (the vision module's uint8 input, stacked with other images' rows), ``grid.dims``
(what the module needs beside the rows: nothing for InternVL's tiles, ``(t, h, w)`` for
Qwen-VL's patches) and ``cache_key``; the family's prompt builder reads its own ``grid``
(InternVL: ``TileGrid``, tiles per image; Qwen-VL: ``preprocessing.qwen_vl.PatchGrid``).
Rows stay uint8; normalisation happens inside the vision encoder, on its device. The content
hash covers the pixels and their shape, so two images with equal pixels share a hash
whatever their file format; the prefix cache keys on it (with the grid).

An *image plan* (``ImagePlan``) is what a model family says about its images: how many
pixels of a ``w x h`` image it can use (``need``, so a large JPEG is decoded only that big)
and how decoded pixels become its ``PreparedImage`` (``prepare``). ``TilingConfig`` is
InternVL's plan, ``preprocessing.qwen_vl.QwenVLPreprocess`` Qwen-VL's; ``prepare_bytes`` and
the drive loop use only the protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from vlmbatch.preprocessing.decode import decode_for
from vlmbatch.preprocessing.resize import KERNELS, resize
from vlmbatch.preprocessing.tiling import (
    TILING_MODES,
    TileGrid,
    fit_scale,
    plan_reduced,
    plan_reference,
)

PAD_RGB = (124, 116, 104)  # ImageNet mean x 255: padding normalises to ~0


@dataclass(frozen=True)
class TilingConfig:
    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True
    mode: str = "reference"  # "reduced" | "reference" (InternVL dynamic_preprocess)
    upscale_limit: float = 1.0  # reduced mode: most a tile count may enlarge the image
    # keep the decoded image in PreparedImage.pixels, for engines that re-tile themselves
    # (lmdeploy); off, a group holds only its tiles
    keep_pixels: bool = False
    # resize.py's kernel: "opencv" (ours), or the processor's under --resize reference
    # ("torchvision": transformers' GotOcr2ImageProcessor; "pillow": the model card's)
    resize: str = "opencv"

    def __post_init__(self) -> None:
        if self.tile_size <= 0 or not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"bad tiling config {self}: need tile_size > 0 and "
                             "1 <= min_tiles <= max_tiles")
        if self.mode not in TILING_MODES:
            raise ValueError(f"tiling mode {self.mode!r} not one of {TILING_MODES}")
        if self.upscale_limit <= 0:
            raise ValueError(f"upscale_limit must be > 0, got {self.upscale_limit}")
        if self.resize not in KERNELS:
            raise ValueError(f"resize kernel {self.resize!r} not one of {tuple(KERNELS)}")

    def need(self, width: int, height: int) -> tuple[int, int]:
        """Most pixels (width, height) of a ``width x height`` image the tiles can use: the
        grid's canvas (stretched), or the letterboxed content; never more than the image.
        A reference kernel needs the full image: the processor resizes from every pixel."""
        g = self.plan(width, height)
        if self.resize != "opencv":
            return width, height
        if g.letterbox:
            s = min(1.0, fit_scale(width, height, self.tile_size, g.cols, g.rows))
            return min(width, math.ceil(width * s)), min(height, math.ceil(height * s))
        return min(width, g.cols * self.tile_size), min(height, g.rows * self.tile_size)

    def prepare(self, img: np.ndarray,
                full_size: tuple[int, int] | None = None) -> PreparedImage:
        """``prepare(img, self, full_size)``: the ``ImagePlan`` method."""
        return prepare(img, self, full_size)

    def plan(self, width: int, height: int) -> TileGrid:
        if self.mode == "reduced":
            return plan_reduced(width, height, self.tile_size, self.min_tiles, self.max_tiles,
                                self.upscale_limit)
        return plan_reference(width, height, self.tile_size, self.min_tiles, self.max_tiles,
                              self.use_thumbnail)


class ImageGrid(Protocol):
    """How a family laid one image out as vision rows (``TileGrid``, ``PatchGrid``)."""

    @property
    def key(self) -> str:
        """The layout as text, part of the prefix cache's image key."""
        ...

    @property
    def dims(self) -> tuple[int, ...]:
        """What the vision module reads beside the rows: () for self-contained tiles,
        ``(t, h, w)`` in patches for Qwen-VL."""
        ...


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image ready for its family's vision module (module docstring)."""
    # uint8 vision input [N, *row_shape]: InternVL tiles [N, S, S, 3] RGB (grid tiles
    # row-major, then the thumbnail); Qwen-VL patch rows [N, C*T*P*P]
    rows: np.ndarray
    grid: ImageGrid
    content_hash: str  # xxh3-128 hex of the pixels (and their shape) the rows come from
    width: int  # of the full image (EXIF-oriented), which the grid was planned on
    height: int
    # the decoded [H, W, 3] image (only with TilingConfig.keep_pixels), for engines that
    # re-tile; a large JPEG's is DCT-reduced (at least as large as the tiles need), so it
    # may be smaller than width x height
    pixels: np.ndarray | None = None

    @property
    def tiles(self) -> np.ndarray:
        """InternVL's name for ``rows``: ``[N, S, S, 3]``."""
        return self.rows

    @property
    def cache_key(self) -> str:
        """Identifies the image tokens: same pixels *and* same layout (grid, row shape)."""
        return f"{self.content_hash}:{self.grid.key}@{self.rows.shape[1]}"


class ImagePlan(Protocol):
    """How a model family's images are prepared (see the module docstring)."""

    def need(self, width: int, height: int) -> tuple[int, int]: ...

    def prepare(self, img: np.ndarray,
                full_size: tuple[int, int] | None = None) -> PreparedImage: ...


def content_hash(img: np.ndarray) -> str:
    h = xxhash.xxh3_128()
    h.update(np.asarray(img.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(img).data)
    return h.hexdigest()


def _fit(img: np.ndarray, cols: int, rows: int, tile: int, letterbox: bool,
         kernel: str = "opencv") -> np.ndarray:
    """``img`` on a (rows*tile, cols*tile) canvas: stretched, or scaled and centred."""
    if not letterbox:
        return resize(img, cols * tile, rows * tile, kernel)
    h, w = img.shape[:2]
    s = fit_scale(w, h, tile, cols, rows)
    cw, ch = min(cols * tile, max(1, round(w * s))), min(rows * tile, max(1, round(h * s)))
    canvas = np.empty((rows * tile, cols * tile, 3), dtype=np.uint8)
    canvas[:] = PAD_RGB
    y, x = (rows * tile - ch) // 2, (cols * tile - cw) // 2
    canvas[y: y + ch, x: x + cw] = resize(img, cw, ch, kernel)
    return canvas


def cut_tiles(img: np.ndarray, grid: TileGrid, tile: int, kernel: str = "opencv") -> np.ndarray:
    """Fit ``img`` [H, W, 3] to the grid (resized with ``kernel``) and cut it; one copy
    beyond the resizes."""
    resized = _fit(img, grid.cols, grid.rows, tile, grid.letterbox, kernel)
    n = grid.num_tiles
    out = np.empty((n, tile, tile, 3), dtype=np.uint8)
    # [rows*S, cols*S, 3] -> [rows, S, cols, S, 3] -> [rows, cols, S, S, 3]
    view = resized.reshape(grid.rows, tile, grid.cols, tile, 3).transpose(0, 2, 1, 3, 4)
    out[: grid.cols * grid.rows] = view.reshape(-1, tile, tile, 3)
    if grid.thumbnail:
        out[-1] = _fit(img, 1, 1, tile, grid.letterbox, kernel)
    return out


def prepare(img: np.ndarray, cfg: TilingConfig,
            full_size: tuple[int, int] | None = None) -> PreparedImage:
    """Decoded ``[H, W, 3]`` uint8 RGB -> tiles in the configured tiling mode.

    ``full_size`` (width, height): ``img`` was decoded reduced (``decode_for``) from an image
    of that size; the grid is planned on the full size, as it would be from full pixels.
    """
    h, w = img.shape[:2]
    fw, fh = full_size or (w, h)
    grid = cfg.plan(fw, fh)
    tiles = cut_tiles(img, grid, cfg.tile_size, cfg.resize)
    return PreparedImage(tiles, grid, content_hash(img), fw, fh,
                         pixels=img if cfg.keep_pixels else None)


def prepare_bytes(data: bytes, plan: ImagePlan, max_pixels: int) -> PreparedImage:
    """Encoded image -> the plan's ``PreparedImage``, decoding a large JPEG only at the size
    the plan needs (DCT-domain reduction, ``decode_for``): the fast path ``vlmbatch run``
    takes."""
    img, full = decode_for(data, plan.need, max_pixels)
    return plan.prepare(img, full)
