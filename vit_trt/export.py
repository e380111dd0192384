"""ONNX export of the vision encoder (uint8 tiles in, LLM-ready embeddings out).

``vlmbatch export-vit --model DIR --out DIR`` writes ``vision.onnx`` with a dynamic batch axis
and ``vision.json`` (model hash, tile size, shapes, opset, max abs error vs torch), then checks
the file with onnxruntime against the torch encoder on random tiles. The graph holds the
normalisation (uint8 -> float), SDPA attention (plain ops at opset 17), pixel shuffle and the
projector, so a runner only moves uint8 tiles in and embeddings out.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.atomic import replaced_on_success
from vit_trt.base import VisionModel

INPUT, OUTPUT = "tiles", "embeds"


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    max_abs_err: float  # onnxruntime vs torch on random tiles


def model_hash(model_dir: Path) -> str:
    """sha256 over config.json and the weight files (names and bytes), first 16 hex digits."""
    h = hashlib.sha256()
    for p in sorted([model_dir / "config.json", *model_dir.glob("*.safetensors")]):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _fp32_cpu_copy(module: nn.Module) -> nn.Module:
    """An fp32 CPU copy of ``module`` (the original keeps its device and dtype)."""
    with torch.no_grad():
        return copy.deepcopy(module).to("cpu", torch.float32).eval()


def export_onnx(vision: VisionModel, out_dir: Path, opset: int = 17,
                check_batch: int = 3) -> ExportResult:
    """Export ``vision.module`` (an fp32 CPU copy of it) and verify it with onnxruntime.

    The module itself is left as it is (device, dtype), so a runner built after the export
    still runs the caller's encoder.
    """
    module = _fp32_cpu_copy(vision.module)
    example = torch.randint(0, 256, (2, *vision.item_shape), dtype=torch.uint8)
    path = out_dir / "vision.onnx"
    with replaced_on_success(path) as part:  # whole or not at all, as vision.json below
        with torch.inference_mode(), warnings.catch_warnings():
            # shapes other than the batch are constants of the graph, as intended
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(module, (example,), str(part), input_names=[INPUT],
                              output_names=[OUTPUT], opset_version=opset, dynamo=False,
                              dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}})
        err = check_onnx(part, module, vision.item_shape, check_batch)
    meta = {"model_hash": model_hash(vision.source), "item_shape": list(vision.item_shape),
            "tile_size": vision.item_shape[0], "tokens_per_tile": vision.out_shape[0],
            "hidden": vision.out_shape[1], "opset": opset, "input": INPUT, "output": OUTPUT,
            "max_abs_err_vs_torch": err}
    with replaced_on_success(out_dir / "vision.json") as part:
        part.write_text(json.dumps(meta, indent=2) + "\n")
    return ExportResult(path, err)


def check_onnx(path: Path, vision: nn.Module, item_shape: tuple[int, ...], batch: int) -> float:
    """Max |onnxruntime - torch| on random uint8 inputs, a batch size not used at export."""
    import onnxruntime as ort  # optional dependency: the onnx extra

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    tiles = torch.randint(0, 256, (batch, *item_shape), dtype=torch.uint8)
    with torch.inference_mode():
        want = vision(tiles).numpy()
    got = sess.run([OUTPUT], {INPUT: tiles.numpy()})[0]
    return float(abs(got - want).max())


def quantize_int8(onnx_path: Path, out_path: Path) -> Path:
    """onnxruntime dynamic int8 quantisation of the exported encoder: MatMul/Gemm weights
    become int8 (per output channel), activations are quantised per call. ``out_path``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # optional: onnx extra

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # it warns on the uint8 input it rightly leaves alone
    try:
        quantize_dynamic(str(onnx_path), str(out_path), weight_type=QuantType.QInt8,
                         per_channel=True)
    finally:
        root.setLevel(level)
    return out_path
