"""ONNX export and the vision runners agree with the torch encoder (fp32, CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.common.registry import UnknownName
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model, vision_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.preprocessing.prepare import prepare
from vlmbatch.vit_trt.base import RunnerOptions, make_runner
from vlmbatch.vit_trt.export import export_onnx
from vlmbatch.vit_trt.onnx_runner import OnnxRuntimeRunner
from vlmbatch.vit_trt.torch_runner import TorchRunner

HAS_TRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


@pytest.fixture(scope="module")
def exported(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    model = load_model(random_model_dir)
    return model, export_onnx(vision_model(model), tmp_path_factory.mktemp("onnx"))


def test_export_dynamic_batch_and_error(exported) -> None:  # noqa: ANN001
    model, result = exported
    assert result.max_abs_err <= 1e-4
    meta = json.loads((result.onnx_path.parent / "vision.json").read_text())
    assert meta["tokens_per_tile"] == model.spec.tokens_per_tile
    runner = OnnxRuntimeRunner(vision_model(model), result.onnx_path)
    for n in (1, 5, 9):  # none of these is the export batch (2)
        tiles = torch.randint(0, 256, (n, 56, 56, 3), dtype=torch.uint8)
        want = TorchRunner(vision_model(model)).encode(tiles)
        assert (runner.encode(tiles) - want).abs().max() <= 1e-4


def test_export_leaves_the_model_as_it_was(random_model_dir: Path, tmp_path: Path) -> None:
    """Exporting works on an fp32 CPU copy: a bf16 model stays bf16 (on CUDA: stays there)."""
    model = load_model(random_model_dir, dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.vision.state_dict().items()}
    result = export_onnx(vision_model(model), tmp_path / "o")
    assert result.max_abs_err <= 1e-4  # the export itself is fp32
    after = model.vision.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], v)
               for k, v in before.items())


def test_engine_answers_equal_across_backends(exported) -> None:  # noqa: ANN001
    model, result = exported
    rng = np.random.default_rng(7)
    ims = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), model.spec.tiling)
           for w, h in [(56, 56), (150, 60)]]
    reqs = [Request(i, q) for i in range(2) for q in ("red?", "Is there a circle?")]
    torch_m = [s.margin for s in TorchEngine(model, EngineConfig()).score(ims, reqs)]
    ort = TorchEngine(model, EngineConfig(),
                      OnnxRuntimeRunner(vision_model(model), result.onnx_path))
    ort_m = [s.margin for s in ort.score(ims, reqs)]
    assert np.abs(np.array(torch_m) - np.array(ort_m)).max() <= 1e-4


def test_cli_export(random_model_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main(["export-vit", "--model", str(random_model_dir), "--out",
                 str(tmp_path / "o")]) == EXIT_OK
    assert (tmp_path / "o" / "vision.onnx").is_file()
    assert "max abs error" in capsys.readouterr().out


def test_unknown_backend(exported) -> None:  # noqa: ANN001
    with pytest.raises(UnknownName, match="unknown vision backend 'nope'; one of: .*torch"):
        make_runner("nope", vision_model(exported[0]), RunnerOptions())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRT, reason="needs tensorrt and a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_tensorrt_matches_torch(random_model_dir: Path, graphs: bool) -> None:
    from vlmbatch.vit_trt.tensorrt_runner import TensorRTRunner

    model = load_model(random_model_dir, device="cuda")
    trt_runner = TensorRTRunner(vision_model(model), precision="fp16", cuda_graphs=graphs)
    for n in (5, 1, 40):  # bucket 8 padded, bucket 1, split at the largest bucket (32)
        tiles = torch.randint(0, 256, (n, 56, 56, 3), dtype=torch.uint8)
        want = TorchRunner(vision_model(model)).encode(tiles).float()
        got = trt_runner.encode(tiles)
        assert got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()) <= 2e-2  # fp16 engine
    assert (len(trt_runner.contexts) > 0) == graphs
