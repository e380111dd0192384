"""Qwen2-VL / Qwen2.5-VL resize grid ("smart resize"): the next model family's tiling.

Qwen2-VL does not cut fixed tiles: it resizes the whole image so that both sides are multiples
of ``factor`` (patch 14 x merge 2 = 28) and the pixel count lies in ``[min_pixels,
max_pixels]``, keeping the aspect ratio as well as rounding allows. The image then yields
``(h / 14) * (w / 14)`` patches and a quarter as many LLM tokens (2x2 merge).

Must equal transformers' ``Qwen2VLImageProcessor`` (tested, no download).
"""

from __future__ import annotations

import math

QWEN2VL_MIN_PIXELS = 56 * 56
QWEN2VL_MAX_PIXELS = 14 * 14 * 4 * 1280


def smart_resize(height: int, width: int, factor: int = 28,
                 min_pixels: int = QWEN2VL_MIN_PIXELS,
                 max_pixels: int = QWEN2VL_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) the image is resized to; both multiples of ``factor``."""
    if min(height, width) <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio over 200 ({width}x{height}) is not supported by Qwen2-VL")
    h = round(height / factor) * factor  # may round to 0 for a thin side: min_pixels fixes it
    w = round(width / factor) * factor
    if h * w > max_pixels:  # shrink by the area ratio, round down to the grid
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:  # grow by the area ratio, round up to the grid
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def llm_tokens(height: int, width: int, patch: int = 14, merge: int = 2) -> int:
    """LLM image tokens for a smart-resized ``height`` x ``width`` image."""
    return (height // patch) * (width // patch) // (merge * merge)
