"""Qwen-VL preprocessing (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): smart resize, then uint8 patches.

Qwen-VL cuts no tiles. The whole image is resized so that both sides are multiples of
``factor = patch * merge`` (28 for Qwen2/2.5-VL's 14 px patches, 32 for Qwen3-VL's 16 px) and
the pixel count lies in ``[min_pixels, max_pixels]`` (``smart_resize``, the image processor's
rule), with INTER_AREA when shrinking and INTER_CUBIC when enlarging (``resize``). The pixels
are then laid out as the vision tower's patch rows, in exactly the order of transformers'
``Qwen2VLImageProcessor`` (which Qwen3-VL uses too):

    patches [gt*gh*gw, C*T*P*P] uint8, gh = h/P, gw = w/P, gt = 1, T = temporal patch (2)

Rows run over merge windows first (window row, window column), then over the ``merge x merge``
patches inside a window (row-major), so that the tower's patch merger takes ``merge**2``
consecutive rows. Within a row the values run channel-major: ``[c][t][py][px]``; a still image
is its own second frame (t = 0 and t = 1 hold the same pixels).

Normalisation (mean/std) is not done here: the vision encoder does it on its device, as for
InternVL, so the record stays uint8 (a quarter of the bytes of float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from preprocessing.qwen2vl import smart_resize
from preprocessing.resize import resize

# preprocessor_config.json values of the released checkpoints (Qwen2-VL/2.5-VL: the image
# processor's own defaults; Qwen3-VL: its "size" shortest_edge / longest_edge)
QWEN2VL_PIXELS = (56 * 56, 28 * 28 * 1280)
QWEN3VL_PIXELS = (65536, 16777216)


@dataclass(frozen=True)
class QwenVLPreprocess:
    """How one checkpoint wants its images: patch/merge/temporal sizes and the pixel range."""

    patch: int = 14
    merge: int = 2
    temporal: int = 2
    min_pixels: int = QWEN2VL_PIXELS[0]
    max_pixels: int = QWEN2VL_PIXELS[1]

    def __post_init__(self) -> None:
        if min(self.patch, self.merge, self.temporal) <= 0:
            raise ValueError(f"patch, merge and temporal sizes must be positive: {self}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels: {self}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merge window, in pixels."""
        return self.patch * self.merge

    @property
    def row_size(self) -> int:
        """Values per patch row: C * T * P * P."""
        return 3 * self.temporal * self.patch * self.patch

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) an ``height x width`` image is resized to."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``grid_thw`` of an ``height x width`` image: (1, h/P, w/P)."""
        h, w = self.target_size(height, width)
        return 1, h // self.patch, w // self.patch

    def tokens(self, height: int, width: int) -> int:
        """LLM image tokens of an ``height x width`` image: gh * gw / merge**2."""
        t, gh, gw = self.grid(height, width)
        return t * gh * gw // (self.merge * self.merge)


@dataclass(frozen=True)
class QwenVLImage:
    """One image, ready for the Qwen-VL vision tower.

    ``patches`` [gt*gh*gw, C*T*P*P] uint8 in the image processor's order (module docstring);
    ``grid_thw`` (gt, gh, gw) in patches; ``width``/``height`` of the decoded source image.
    ``content_hash`` covers the resized pixels the tower sees and the grid, so it identifies
    the image tokens: the prefix cache keys the image span on it.
    """

    patches: np.ndarray
    grid_thw: tuple[int, int, int]
    merge: int
    content_hash: str
    width: int
    height: int

    @property
    def tokens(self) -> int:
        """LLM tokens of this image (length of its ``<|image_pad|>`` run)."""
        t, gh, gw = self.grid_thw
        return t * gh * gw // (self.merge * self.merge)

    @property
    def cache_key(self) -> str:
        t, gh, gw = self.grid_thw
        return f"{self.content_hash}:{t}x{gh}x{gw}"


def patchify(img: np.ndarray, cfg: QwenVLPreprocess) -> np.ndarray:
    """Resized ``[h, w, 3]`` uint8 (sides multiples of ``cfg.factor``) -> patch rows
    ``[gh*gw, 3*T*P*P]`` uint8 in the image processor's order; one copy."""
    h, w, c = img.shape
    p, m, t = cfg.patch, cfg.merge, cfg.temporal
    if c != 3 or h % cfg.factor or w % cfg.factor:
        raise ValueError(f"need [h, w, 3] with h, w multiples of {cfg.factor}; got {img.shape}")
    gh, gw = h // p, w // p
    # [h, w, c] = [wy, my, py, wx, mx, px, c]: window, in-window patch, in-patch pixel, per axis
    x = img.reshape(gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # [wy, wx, my, mx, c, py, px]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # frame repeated
    return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p)


def image_hash(pixels: np.ndarray, grid_thw: tuple[int, int, int], patch: int) -> str:
    """xxh3-128 over the grid, the patch size, the pixel shape and the pixels."""
    h = xxhash.xxh3_128()
    h.update(np.asarray([*grid_thw, patch, *pixels.shape], dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()


def prepare_qwen_vl(img: np.ndarray, cfg: QwenVLPreprocess) -> QwenVLImage:
    """Decoded ``[H, W, 3]`` uint8 RGB -> ``QwenVLImage`` (smart resize, then patches)."""
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"need a [H, W, 3] uint8 RGB image, got {img.shape} {img.dtype}")
    height, width = img.shape[:2]
    h, w = cfg.target_size(height, width)
    resized = resize(img, w, h)
    grid = (1, h // cfg.patch, w // cfg.patch)
    return QwenVLImage(patchify(resized, cfg), grid, cfg.merge,
                       image_hash(resized, grid, cfg.patch), width, height)
