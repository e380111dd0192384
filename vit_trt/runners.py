"""Vision-encoder runners behind one interface: ``encode(tiles) -> embeddings``.

``tiles`` is uint8 ``[N, S, S, 3]`` (a torch tensor on the CPU); the result is float
``[N, T, D_text]`` on the runner's device. Backends (``--vit-backend``):

- ``torch``: our SDPA encoder (CPU or CUDA; fp32/bf16/fp16); on CUDA, optionally through the
  batch-size-bucketed CUDA graph pool (``cudagraph_pool``);
- ``onnxruntime``: the exported ONNX (``vit_trt/export.py``) on the CPU execution provider, or
  CUDA's when onnxruntime-gpu is installed;
- ``onnxruntime-int8``: the same ONNX after onnxruntime's dynamic int8 quantisation (int8
  weights, activations quantised per call), CPU;
- ``tensorrt``: an engine built from that ONNX (``vit_trt/tensorrt_runner.py``), GPU only.

``make_runner`` picks one by name; ``default_backend`` the one ``auto`` means: ``torch`` on the
CPU (end to end level with onnxruntime and no extra dependency: docs/vision.md), ``tensorrt``
on CUDA when it imports (never measured: it has not run anywhere), else ``torch`` (with the
graph pool: 1.85x eager at batch 1 for the InternViT-300M shape on an H200, docs/gpu.md).
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from pipeline.model import LoadedModel

BACKENDS = ("torch", "onnxruntime", "onnxruntime-int8", "tensorrt")


class VitRunner(ABC):
    """Invariant: ``encode`` returns exactly one embedding row block per input tile, in order,
    and the result is complete (safe to read from any stream or the CPU) when returned; a
    ``TorchRunner`` built ``stream_ordered`` promises only that work queued after it on the
    current CUDA stream sees it complete (what ``TorchEngine`` needs: it reads the result on
    that stream), which spares the host a wait per call."""

    @abstractmethod
    def encode(self, tiles: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, S, S, 3]`` -> ``[N, T, D_text]``."""


class TorchRunner(VitRunner):
    def __init__(self, model: LoadedModel, cuda_graphs: bool = False, max_batch: int = 32,
                 stream_ordered: bool = False) -> None:
        self.vision = model.vision
        p = next(self.vision.parameters())
        self.device = p.device
        self.pool = None
        if cuda_graphs and self.device.type == "cuda":
            from cudagraph_pool import GraphPool

            tile = model.spec.tiling.tile_size
            # the pool's guard (a host wait on an event after each call) protects readers on
            # other streams or the CPU; a stream-ordered consumer needs none
            self.pool = GraphPool(self.vision, (tile, tile, 3), torch.uint8, self.device,
                                  max_batch=max_batch, sync=not stream_ordered)

    @torch.inference_mode()
    def encode(self, tiles: torch.Tensor) -> torch.Tensor:
        x = tiles.to(self.device, non_blocking=True)
        return self.pool(x) if self.pool is not None else self.vision(x)


class OnnxRuntimeRunner(VitRunner):
    def __init__(self, model: LoadedModel, onnx_path: Path | None = None,
                 device: str = "cpu", threads: int | None = None, int8: bool = False) -> None:
        import onnxruntime as ort

        if onnx_path is None or int8:
            self._tmp = tempfile.TemporaryDirectory(prefix="vlmbatch-vit-")
        if onnx_path is None:  # export on the fly into a temporary folder
            from vit_trt.export import export_onnx

            onnx_path = export_onnx(model, Path(self._tmp.name)).onnx_path
        if int8:
            from vit_trt.export import quantize_int8

            onnx_path = quantize_int8(onnx_path, Path(self._tmp.name) / "vision.int8.onnx")
        opts = ort.SessionOptions()
        # idle intra-op threads must not spin: the language model runs on the same cores
        # between encoder calls (spinning halved end-to-end QPM on 2 cores)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            opts.intra_op_num_threads = threads
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ImportError("onnxruntime has no CUDA execution provider here; install "
                                  "onnxruntime-gpu (in an env without onnxruntime)")
            providers.insert(0, "CUDAExecutionProvider")
        self.onnx_path = Path(onnx_path)
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
        self.device = torch.device(device)

    def encode(self, tiles: torch.Tensor) -> torch.Tensor:
        from vit_trt.export import INPUT, OUTPUT

        out = self.session.run([OUTPUT], {INPUT: tiles.cpu().numpy()})[0]
        return torch.from_numpy(out).to(self.device)


def default_backend(device: str) -> str:
    """What ``--vit-backend auto`` means on ``device`` (see the module docstring)."""
    import importlib.util

    if device.startswith("cuda") and importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    return "torch"


def make_runner(backend: str, model: LoadedModel, device: str = "cpu",
                onnx_path: Path | None = None, cuda_graphs: bool = True,
                stream_ordered: bool = False) -> VitRunner:
    """``stream_ordered``: see ``VitRunner`` (the torch backend only; the others always
    return complete results)."""
    if backend == "torch":
        return TorchRunner(model, cuda_graphs=cuda_graphs, stream_ordered=stream_ordered)
    if backend in ("onnxruntime", "onnxruntime-int8"):
        try:
            return OnnxRuntimeRunner(model, onnx_path, device, int8=backend.endswith("int8"))
        except ModuleNotFoundError as e:
            raise ImportError("--vit-backend onnxruntime needs the onnx extra: "
                              "pip install 'vlmbatch[onnx]'") from e
    if backend == "tensorrt":
        from vit_trt.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(model, onnx_path, cuda_graphs=cuda_graphs)
    raise ValueError(f"vit backend {backend!r} not one of {BACKENDS}")
