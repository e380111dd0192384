"""Vision-encoder runners behind ``encode(pixels)`` (``base.py``: the interface, the
``RUNNERS`` registry, ``make_runner``): torch, optionally CUDA-graph pooled
(``torch_runner.py``), ``torch.compile`` (``compile_runner.py``), onnxruntime
(``onnx_runner.py``), TensorRT (``tensorrt_runner.py``),
and the ONNX export they share (``export.py``). Importing the package registers them all.
A runner wraps the vision module a model family built (``models/``)."""

from vlmbatch.vit_trt import compile_runner as _compile  # noqa: F401  (each registers its backends)
from vlmbatch.vit_trt import onnx_runner as _ort  # noqa: F401
from vlmbatch.vit_trt import tensorrt_runner as _trt  # noqa: F401
from vlmbatch.vit_trt import torch_runner as _torch  # noqa: F401
from vlmbatch.vit_trt.base import RUNNERS, RunnerOptions, VisionModel, VitRunner, make_runner

__all__ = ["RUNNERS", "RunnerOptions", "VisionModel", "VitRunner", "make_runner"]
