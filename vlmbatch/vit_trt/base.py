"""Vision-encoder runners behind one interface: ``encode(pixels) -> embeddings``.

``pixels`` is uint8 ``[N, *item_shape]`` (a torch tensor on the CPU; for InternVL tiles
``[N, S, S, 3]``); the result is float ``[N, *out_shape]`` on the runner's device. A
*packed* vision model (Qwen-VL: images of different sizes as patch rows, ``models.base``)
is run with ``encode_packed(rows, dims) -> VisionOutput`` instead, by the runners that
support it (torch). A runner wraps a ``VisionModel`` (the vision module a model family
built, plus its shapes), never the whole loaded model. Backends (``--vit-backend``), each
a factory named in ``RUNNERS`` (the package's ``__init__``) and defined in its module:

- ``torch`` (``torch_runner.py``): the module itself (CPU or CUDA; fp32/bf16/fp16); on CUDA,
  optionally through the batch-size-bucketed CUDA graph pool (``cudagraph_pool``);
- ``onnxruntime`` / ``onnxruntime-int8`` (``onnx_runner.py``): the exported ONNX
  (``export.py``) on the CPU execution provider (CUDA's with onnxruntime-gpu), the second
  after onnxruntime's dynamic int8 quantisation;
- ``tensorrt`` (``tensorrt_runner.py``): an engine built from that ONNX, GPU only.

``default_backend`` says what ``auto`` means: ``torch`` on the CPU (end to end level with
onnxruntime and no extra dependency: docs/vision.md), ``tensorrt`` on CUDA when it imports
(never measured: it has not run anywhere), else ``torch`` (with the graph pool, faster than
eager at small batches on an H200: docs/figures.md#gpu-vit-graph-pool).
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlmbatch.cudagraph_pool.budget import BudgetPool
from vlmbatch.cudagraph_pool.pool import GraphPool
from vlmbatch.models.base import BudgetForward, VisionOutput
from vlmbatch.vit_trt import RUNNERS


@dataclass(frozen=True)
class VisionModel:
    """What a runner runs: ``module`` maps uint8 ``[N, *item_shape]`` to float
    ``[N, *out_shape]``, or with ``packed``, uint8 rows of several images and each image's
    dims to a ``VisionOutput`` (``models.base``); ``source`` is the checkpoint folder (keys
    ONNX/plan caches); ``budget``: a packed module's static-shape form, which the graph
    pool captures per token budget."""
    module: nn.Module
    item_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    source: Path
    packed: bool = False
    budget: BudgetForward | None = None

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device


@dataclass(frozen=True)
class RunnerOptions:
    device: str = "cpu"
    cuda_graphs: bool = True  # torch/tensorrt on CUDA: through the graph pool
    # the largest batch (graph bucket, TensorRT profile maximum) a runner prepares for;
    # larger calls are split
    max_batch: int = 32
    # packed models: the largest token budget (patch rows) a graph is captured for
    max_budget: int = 16384
    # the consumer reads results on the stream that made them (see ``VitRunner``)
    stream_ordered: bool = False
    onnx_path: Path | None = None  # onnxruntime/tensorrt: use this export instead of making one


class VitRunner(ABC):
    """Invariant: ``encode`` returns exactly one embedding row block per input row, in
    order, and the result is complete (safe to read from any stream or the CPU) when
    returned; a runner built ``stream_ordered`` promises only that work queued after it on
    the current CUDA stream sees it complete (what the torch engine needs: it reads the
    result on that stream), which spares the host a wait per call."""

    pool: GraphPool | BudgetPool | None = None  # where the runner replays CUDA graphs
    packed: bool = False  # runs a packed vision model: call ``encode_packed``

    @abstractmethod
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, *item_shape]`` -> ``[N, *out_shape]``."""

    def encode_packed(self, rows: torch.Tensor,
                      dims: Sequence[tuple[int, ...]]) -> VisionOutput:
        """A packed model's images: uint8 rows ``[N, *item_shape]`` (images one after
        another) and each image's ``grid.dims`` -> their tokens, in order."""
        raise NotImplementedError(f"{type(self).__name__} runs tile models only")


RunnerFactory = Callable[[VisionModel, RunnerOptions], VitRunner]


def default_backend(device: str) -> str:
    """What ``--vit-backend auto`` means on ``device`` (see the module docstring)."""
    if device.startswith("cuda") and importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    return "torch"


def make_runner(backend: str, vision: VisionModel, opts: RunnerOptions) -> VitRunner:
    """The runner registered as ``backend`` (``auto``: ``default_backend``; torch for a
    packed model, the one backend that runs it)."""
    if backend == "auto":
        backend = "torch" if vision.packed else default_backend(opts.device)
    return RUNNERS.get(backend)(vision, opts)
