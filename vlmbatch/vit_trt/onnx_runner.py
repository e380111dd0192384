"""The ``onnxruntime`` and ``onnxruntime-int8`` vision backends: the exported ONNX
(``vit_trt/export.py``, made on the fly unless a file is given) in an onnxruntime session."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from vlmbatch.models.config_io import ModelError
from vlmbatch.vit_trt.base import RunnerOptions, VisionModel, VitRunner
from vlmbatch.vit_trt.export import INPUT, OUTPUT, export_onnx, quantize_int8

PACKED = ("a packed vision model (Qwen-VL: images of any size as patch rows) exports only at "
          "a fixed token budget (`vlmbatch export-vit`), and no {} runner packs images into "
          "it yet; use --vit-backend torch")


class OnnxRuntimeRunner(VitRunner):
    def __init__(self, vision: VisionModel, onnx_path: Path | None = None,
                 device: str = "cpu", threads: int | None = None, int8: bool = False) -> None:
        if vision.packed:
            raise ModelError(PACKED.format("onnxruntime"))
        try:  # optional dependency: the onnx extra
            import onnxruntime as ort
        except ModuleNotFoundError as e:
            raise ImportError("--vit-backend onnxruntime needs the onnx extra: "
                              "pip install 'vlmbatch[onnx]'") from e
        if onnx_path is None or int8:
            self._tmp = tempfile.TemporaryDirectory(prefix="vlmbatch-vit-")
        if onnx_path is None:  # export on the fly into a temporary folder
            onnx_path = export_onnx(vision, Path(self._tmp.name)).onnx_path
        if int8:
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

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.session.run([OUTPUT], {INPUT: pixels.cpu().numpy()})[0]
        return torch.from_numpy(out).to(self.device)


def build_ort(vision: VisionModel, opts: RunnerOptions) -> OnnxRuntimeRunner:
    return OnnxRuntimeRunner(vision, opts.onnx_path, opts.device)


def build_ort_int8(vision: VisionModel, opts: RunnerOptions) -> OnnxRuntimeRunner:
    return OnnxRuntimeRunner(vision, opts.onnx_path, opts.device, int8=True)
