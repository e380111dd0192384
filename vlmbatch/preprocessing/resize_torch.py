"""The ``torchvision`` resize kernel (``resize.py``): transformers' torchvision-backend resize.

transformers' ``Qwen2VLImageProcessor`` and ``GotOcr2ImageProcessor`` turn an ``[H, W, 3]``
uint8 array into ``torch.from_numpy(a).permute(2, 0, 1)``, add a batch dimension (one image per
group on the CPU) and call ``tvF.resize(x, size, BICUBIC, antialias=True)``, which on the CPU
hands the uint8 tensor to ``torch.nn.functional.interpolate(mode="bicubic",
align_corners=False, antialias=True)`` (its native uint8 kernel, rounding inside). This module
makes the same call on the same tensor; torch only, so a decoder process imports it only when
``--resize reference`` asks for this kernel. Checked against the processors themselves in
``tests/preprocessing/test_resize_reference.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def resize_torchvision(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """``img`` [H, W, 3] uint8 -> [height, width, 3] uint8, as the processors resize it."""
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W]
    out = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False,
                        antialias=True)
    return np.ascontiguousarray(out[0].permute(1, 2, 0).numpy())
