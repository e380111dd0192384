"""ONNX export of the vision encoder (uint8 tiles in, LLM-ready embeddings out).

``vlmbatch export-vit --model DIR --out DIR`` writes ``vision.onnx`` with a dynamic batch axis
and ``vision.json`` (model hash, tile size, shapes, opset, max abs error vs torch), then checks
the file with onnxruntime against the torch encoder on random tiles. The graph holds the
normalisation (uint8 -> float), SDPA attention (plain ops at opset 17), pixel shuffle and the
projector, so a runner only moves uint8 tiles in and embeddings out.

A packed model (Qwen-VL) has no batch axis: its eager forward makes per-grid index maths on
the host, which a traced graph would freeze. Its static-shape form (``BudgetForward``,
``models/qwen_vl/vision_static.py``) exports instead, at one token budget (``budget`` patch
rows): inputs ``rows`` and the meta tensors by name, outputs the embeddings (and Qwen3-VL's
DeepStack features); checked with onnxruntime on a packing of two grids other than the
export's. No runner feeds it yet (``onnx_runner.py`` refuses packed models).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.vit_trt import OPSET
from vlmbatch.vit_trt.base import VisionModel

INPUT, OUTPUT = "tiles", "embeds"
ROWS = "rows"  # a packed model's input: its images' rows, padded to the budget


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


def export_onnx(vision: VisionModel, out_dir: Path, opset: int = OPSET,
                check_batch: int = 3, budget: int = 4096) -> ExportResult:
    """Export ``vision.module`` (an fp32 CPU copy of it) and verify it with onnxruntime;
    a packed model at ``budget`` rows (module docstring).

    The module itself is left as it is (device, dtype), so a runner built after the export
    still runs the caller's encoder.
    """
    module = _fp32_cpu_copy(vision.module)
    path = out_dir / "vision.onnx"
    with replaced_on_success(path) as part:  # whole or not at all, as vision.json below
        if vision.packed:
            meta = _export_packed(vision, module, part, opset, budget)
        else:
            meta = _export_tiles(vision, module, part, opset, check_batch)
    meta = {"model_hash": model_hash(vision.source), **meta, "opset": opset}
    with replaced_on_success(out_dir / "vision.json") as part:
        part.write_text(json.dumps(meta, indent=2) + "\n")
    return ExportResult(path, meta["max_abs_err_vs_torch"])


def _trace(module: nn.Module, args: tuple, path: Path, opset: int, **kw: object) -> None:
    with torch.inference_mode(), warnings.catch_warnings():
        # shapes other than the batch are constants of the graph, as intended
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module, args, str(path), opset_version=opset, dynamo=False,
                          **kw)  # type: ignore[arg-type]


def _export_tiles(vision: VisionModel, module: nn.Module, path: Path, opset: int,
                  check_batch: int) -> dict:
    example = torch.randint(0, 256, (2, *vision.item_shape), dtype=torch.uint8)
    _trace(module, (example,), path, opset, input_names=[INPUT], output_names=[OUTPUT],
           dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}})
    err = check_onnx(path, module, vision.item_shape, check_batch)
    return {"item_shape": list(vision.item_shape), "tile_size": vision.item_shape[0],
            "tokens_per_tile": vision.out_shape[0], "hidden": vision.out_shape[1],
            "input": INPUT, "output": OUTPUT, "max_abs_err_vs_torch": err}


class _AtBudget(nn.Module):
    """``BudgetForward.forward`` with the meta tensors as positional inputs, by ``keys``."""

    def __init__(self, module: nn.Module, forward: Callable, keys: list[str]) -> None:
        super().__init__()
        self.module, self.fn, self.keys = module, forward, keys

    def forward(self, rows: torch.Tensor, *meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fn(self.module, rows, dict(zip(self.keys, meta)))


def _export_packed(vision: VisionModel, module: nn.Module, path: Path, opset: int,
                   budget: int) -> dict:
    b = vision.budget
    if b is None:
        raise ValueError("this packed vision model has no static-shape form, so it cannot be "
                         "exported to ONNX (its forward does per-image index maths on the "
                         "host, which a traced graph would freeze)")
    cpu = torch.device("cpu")
    u = int(round(b.unit ** 0.5))  # merge size: grids in merge units
    dims = [[(1, 2 * u, 2 * u)], [(1, 2 * u, 4 * u), (1, 4 * u, 2 * u)]]  # export, check
    metas = [b.meta(module, d, budget, cpu) for d in dims]
    keys = sorted(metas[0])
    wrapper = _AtBudget(module, b.forward, keys).eval()
    rows = [torch.randint(0, 256, (budget, *vision.item_shape), dtype=torch.uint8)
            for _ in dims]
    _trace(wrapper, (rows[0], *[metas[0][k] for k in keys]), path, opset,
           input_names=[ROWS, *keys])
    import onnxruntime as ort  # optional dependency: the onnx extra

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {ROWS: rows[1].numpy(), **{k: metas[1][k].detach().numpy() for k in keys}}
    got = sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})
    with torch.inference_mode():
        want = wrapper(rows[1], *[metas[1][k] for k in keys])
    err = max(float(abs(g - w.numpy()).max()) for g, w in zip(got, want))
    return {"packed": True, "budget": budget, "row_size": list(vision.item_shape),
            "hidden": vision.out_shape[0], "inputs": [ROWS, *keys],
            "outputs": len(want), "max_abs_err_vs_torch": err}


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
