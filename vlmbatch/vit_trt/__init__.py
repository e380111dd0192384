"""Vision-encoder runners behind ``encode(pixels)`` (``base.py``: the interface,
``make_runner``): torch, optionally CUDA-graph pooled (``torch_runner.py``),
``torch.compile`` (``compile_runner.py``), onnxruntime (``onnx_runner.py``), TensorRT
(``tensorrt_runner.py``), and the ONNX export they share (``export.py``). A runner wraps the
vision module a model family built (``models/``).

``RUNNERS`` names each backend's factory as ``"module:attr"``: the ``--vit-backend`` choices
import no runner (nor torch); ``make_runner`` imports the one it builds. The package's other
public names resolve to ``base.py`` on first use (module ``__getattr__``), so importing
``vlmbatch.vit_trt`` for ``RUNNERS`` stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from vlmbatch.common.registry import Registry

__all__ = ["RUNNERS", "RunnerOptions", "VisionModel", "VitRunner", "make_runner"]

# each a ``base.RunnerFactory`` (typed there: this module imports nothing of base.py, so that
# base.py may import RUNNERS without a cycle; code inside vlmbatch imports from base.py)
RUNNERS: Registry[Callable[..., Any]] = Registry("vision backend", {
    "compile": "vlmbatch.vit_trt.compile_runner:build_compiled",
    "onnxruntime": "vlmbatch.vit_trt.onnx_runner:build_ort",
    "onnxruntime-int8": "vlmbatch.vit_trt.onnx_runner:build_ort_int8",
    "tensorrt": "vlmbatch.vit_trt.tensorrt_runner:build_tensorrt",
    "torch": "vlmbatch.vit_trt.torch_runner:build_torch_runner",
})
OPSET = 17  # export.py's default ONNX opset (SDPA exports as plain ops in 17-20)
_BASE = ("RunnerOptions", "VisionModel", "VitRunner", "make_runner")  # from base.py, lazily


def __getattr__(name: str) -> Any:
    if name not in _BASE:
        raise AttributeError(f"module 'vlmbatch.vit_trt' has no attribute {name!r}")
    value = getattr(importlib.import_module("vlmbatch.vit_trt.base"), name)
    globals()[name] = value  # resolved once
    return value
