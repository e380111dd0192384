"""Qwen-VL preprocessing (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): smart resize, then uint8 patches.

Qwen-VL cuts no tiles. The whole image is resized so that both sides are multiples of
``factor = patch * merge`` (28 for Qwen2/2.5-VL's 14 px patches, 32 for Qwen3-VL's 16 px) and
the pixel count lies in ``[min_pixels, max_pixels]`` (``smart_resize``, the image processor's
rule), with INTER_AREA when shrinking and INTER_CUBIC when enlarging (``resize``; under
``--resize reference`` the processor's own torchvision bicubic, ``resize.py``). The pixels
are then laid out as the vision tower's patch rows, in exactly the order of transformers'
``Qwen2VLImageProcessor`` (which Qwen3-VL uses too):

    patches [gt*gh*gw, C*T*P*P] uint8, gh = h/P, gw = w/P, gt = 1, T = temporal patch (2)

Rows run over merge windows first (window row, window column), then over the ``merge x merge``
patches inside a window (row-major), so that the tower's patch merger takes ``merge**2``
consecutive rows. Within a row the values run channel-major: ``[c][t][py][px]``; a still image
is its own second frame (t = 0 and t = 1 hold the same pixels).

Normalisation (mean/std) is not done here: the vision encoder does it on its device, as for
InternVL, so the record stays uint8 (a quarter of the bytes of float32).

``QwenVLPreprocess`` is the family's image plan (``preprocessing.prepare.ImagePlan``): ``need``
tells the decoder how many pixels the resize keeps (a large JPEG is DCT-reduced to that),
``prepare`` makes the ``PreparedImage`` (patch rows + ``PatchGrid``), planned on the full
image's size whatever size the pixels were decoded at. ``with_max_tokens`` is
``--max-image-tokens``: it lowers ``max_pixels`` to ``tokens * factor**2``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import xxhash

from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen2vl import smart_resize
from vlmbatch.preprocessing.resize import KERNELS, resize

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
    # resize.py's kernel: "opencv" (ours) or, under --resize reference, "torchvision"
    # (transformers' Qwen2VLImageProcessor, what AutoImageProcessor gives beside torchvision)
    resize: str = "opencv"

    def __post_init__(self) -> None:
        if min(self.patch, self.merge, self.temporal) <= 0:
            raise ValueError(f"patch, merge and temporal sizes must be positive: {self}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels: {self}")
        if self.resize not in KERNELS:
            raise ValueError(f"resize kernel {self.resize!r} not one of {tuple(KERNELS)}")

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

    def with_max_tokens(self, tokens: int) -> QwenVLPreprocess:
        """This plan with at most ``tokens`` image tokens per image (``--max-image-tokens``):
        ``max_pixels`` lowered to ``tokens * factor**2`` (one token per merge window);
        ValueError if that is below ``min_pixels``."""
        cap = tokens * self.factor * self.factor
        if cap < self.min_pixels:
            raise ValueError(f"max_image_tokens {tokens} is below the checkpoint's min_pixels "
                             f"{self.min_pixels} ({-(-self.min_pixels // self.factor ** 2)} "
                             "tokens); give a larger budget")
        return replace(self, max_pixels=min(self.max_pixels, cap))

    def need(self, width: int, height: int) -> tuple[int, int]:
        """``ImagePlan.need``: the resized size, never more than the image (width, height);
        the whole image for a reference kernel, which resizes from every pixel."""
        if self.resize != "opencv":
            return width, height
        h, w = self.target_size(height, width)
        return min(width, w), min(height, h)

    def prepare(self, img: np.ndarray,
                full_size: tuple[int, int] | None = None) -> PreparedImage:
        """``ImagePlan.prepare``: ``prepare_qwen_vl(img, self, full_size)``."""
        return prepare_qwen_vl(img, self, full_size)


@dataclass(frozen=True)
class PatchGrid:
    """``ImageGrid`` of a Qwen-VL image: ``grid_thw`` in patches and the merge size.

    The image has ``t*h*w`` patch rows and ``tokens = t*h*w / merge**2`` LLM tokens (the
    length of its ``<|image_pad|>`` run)."""

    t: int
    h: int
    w: int
    merge: int

    @property
    def thw(self) -> tuple[int, int, int]:
        return self.t, self.h, self.w

    @property
    def tokens(self) -> int:
        return self.t * self.h * self.w // (self.merge * self.merge)

    @property
    def key(self) -> str:
        return f"{self.t}x{self.h}x{self.w}"

    @property
    def dims(self) -> tuple[int, ...]:
        return self.thw


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


def prepare_qwen_vl(img: np.ndarray, cfg: QwenVLPreprocess,
                    full_size: tuple[int, int] | None = None) -> PreparedImage:
    """Decoded ``[H, W, 3]`` uint8 RGB -> ``PreparedImage`` (smart resize, then patch rows
    ``[t*h*w, C*T*P*P]`` and a ``PatchGrid``). ``content_hash`` covers the resized pixels
    the tower sees, the grid and the patch size, so it identifies the image tokens.

    ``full_size`` (width, height): ``img`` was decoded reduced from an image of that size
    (``decode_for``); the target size is planned on the full size."""
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"need a [H, W, 3] uint8 RGB image, got {img.shape} {img.dtype}")
    width, height = full_size or (img.shape[1], img.shape[0])
    h, w = cfg.target_size(height, width)
    resized = resize(img, w, h, cfg.resize)
    grid = PatchGrid(1, h // cfg.patch, w // cfg.patch, cfg.merge)
    return PreparedImage(patchify(resized, cfg), grid, image_hash(resized, grid.thw, cfg.patch),
                         width, height)
