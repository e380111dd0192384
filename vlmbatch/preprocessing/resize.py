"""Resize policy: INTER_AREA when shrinking, INTER_CUBIC when enlarging.

OpenCV's bicubic filter does not widen its support when downscaling, so it aliases (the ripple
artefacts the 58.com write-up saw); INTER_AREA averages the covered source pixels instead.
When one axis shrinks and the other grows, each axis is resized in its own pass with its own
filter (shrinking axis first, so the second pass works on fewer pixels).

Arrays are ``[H, W, C]`` uint8 RGB throughout.
"""

from __future__ import annotations

import cv2
import numpy as np


def _interp(src: int, dst: int) -> int:
    return cv2.INTER_AREA if dst < src else cv2.INTER_CUBIC


def resize(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """Resize ``img`` to ``width`` x ``height`` with the per-axis policy above."""
    h, w = img.shape[:2]
    if (w, h) == (width, height):
        return img
    shrink_w, shrink_h = width <= w, height <= h
    if shrink_w == shrink_h:  # both shrink or both grow: one pass
        return cv2.resize(img, (width, height), interpolation=_interp(w * h, width * height))
    if shrink_w:  # shrink x first, then grow y
        img = cv2.resize(img, (width, h), interpolation=cv2.INTER_AREA)
        return cv2.resize(img, (width, height), interpolation=cv2.INTER_CUBIC)
    img = cv2.resize(img, (w, height), interpolation=cv2.INTER_AREA)
    return cv2.resize(img, (width, height), interpolation=cv2.INTER_CUBIC)
