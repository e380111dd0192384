"""The resize kernels: one function, ``resize(img, width, height, kernel)``, for images and frames.

``opencv`` (the default, ``--resize opencv``): INTER_AREA when shrinking, INTER_CUBIC when
enlarging. OpenCV's bicubic filter does not widen its support when downscaling, so it aliases
(the ripple artefacts the 58.com write-up saw); INTER_AREA averages the covered source pixels
instead. When one axis shrinks and the other grows, each axis is resized in its own pass with
its own filter (shrinking axis first, so the second pass works on fewer pixels).

``--resize reference`` gives the pixels of the image processor a family's transformers (or
vLLM) pipeline uses, so that its P(yes) is reproduced exactly (``docs/preprocessing.md``):

- ``torchvision`` (``resize_torch.py``): transformers' torchvision-backend processors, which
  ``AutoImageProcessor`` picks whenever torchvision is installed (as beside vLLM):
  ``Qwen2VLImageProcessor`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and ``GotOcr2ImageProcessor``
  (HF-native InternVL). Their ``tvF.resize(BICUBIC, antialias=True)`` on a uint8 tensor is,
  on the CPU, torch's own antialiased bicubic on uint8, which ``resize_torch.py`` calls as
  torchvision does (torchvision itself is not needed).
- ``pillow``: Pillow's bicubic, the model card's ``dynamic_preprocess`` of the original InternVL
  checkpoints (``internvl_chat``) and transformers' ``pil`` backend processors (what
  ``AutoImageProcessor`` gives without torchvision); ``--resize pillow`` picks it for every
  family.

Kernels are named by ``"module:attr"`` (``KERNELS``), so a decoder process imports torch only
when the ``torchvision`` kernel is used. A family's image plan names its kernel
(``reference_kernel``); the modes' names are in ``tiling.py`` (light, for the configs). Arrays
are ``[H, W, C]`` uint8 RGB throughout.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

import cv2
import numpy as np
from PIL import Image

Kernel = Callable[[np.ndarray, int, int], np.ndarray]  # (img, width, height) -> resized
# name -> "module:attr", imported on first use as common/registry.py's registries do (that
# class sits on this package's own row, so it is not imported here)
KERNELS = {
    "opencv": "vlmbatch.preprocessing.resize:resize_opencv",
    "torchvision": "vlmbatch.preprocessing.resize_torch:resize_torchvision",
    "pillow": "vlmbatch.preprocessing.resize:resize_pillow",
}


def kernel_of(name: str) -> Kernel:
    """The kernel ``name`` (its module imported on first use); ValueError naming the kernels
    for an unknown one."""
    if name not in KERNELS:
        raise ValueError(f"resize kernel {name!r} not one of {tuple(KERNELS)}")
    module, _, attr = KERNELS[name].partition(":")
    return cast(Kernel, getattr(importlib.import_module(module), attr))


def reference_kernel(mode: str, processor_kernel: str) -> str:
    """The kernel of a ``--resize`` mode for a family whose processor uses
    ``processor_kernel``: ``reference`` is the processor's; ``opencv`` and ``pillow`` are
    those kernels whatever the family."""
    return processor_kernel if mode == "reference" else mode


def resize(img: np.ndarray, width: int, height: int, kernel: str = "opencv") -> np.ndarray:
    """``img`` [H, W, 3] uint8 RGB resized to ``width`` x ``height`` with ``kernel`` (one of
    ``KERNELS``)."""
    resize_with = kernel_of(kernel)
    h, w = img.shape[:2]
    if (w, h) == (width, height):
        return img  # every kernel leaves an equal size alone (torchvision returns it as is)
    return resize_with(img, width, height)


def resize_pillow(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """Pillow's bicubic (the model card's ``image.resize(size, BICUBIC)``)."""
    out = Image.fromarray(np.ascontiguousarray(img)).resize((width, height),
                                                            Image.Resampling.BICUBIC)
    return np.asarray(out)


def _interp(src: int, dst: int) -> int:
    return cv2.INTER_AREA if dst < src else cv2.INTER_CUBIC


def resize_opencv(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """The per-axis INTER_AREA / INTER_CUBIC policy of the module docstring."""
    h, w = img.shape[:2]
    shrink_w, shrink_h = width <= w, height <= h
    if shrink_w == shrink_h:  # both shrink or both grow: one pass
        return cv2.resize(img, (width, height), interpolation=_interp(w * h, width * height))
    if shrink_w:  # shrink x first, then grow y
        img = cv2.resize(img, (width, h), interpolation=cv2.INTER_AREA)
        return cv2.resize(img, (width, height), interpolation=cv2.INTER_CUBIC)
    img = cv2.resize(img, (w, height), interpolation=cv2.INTER_AREA)
    return cv2.resize(img, (width, height), interpolation=cv2.INTER_CUBIC)
