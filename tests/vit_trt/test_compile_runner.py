"""``--vit-backend compile``: ``torch.compile`` of the vision encoder, padded to the pool's
batch buckets, equals the eager encoder (fp32, CPU). Each bucket compiles once (seconds on
a CPU), so the test uses two buckets."""

from __future__ import annotations

from pathlib import Path

import torch

from vlmbatch.engine.loading import load_model, vision_model
from vlmbatch.vit_trt import RUNNERS
from vlmbatch.vit_trt.base import RunnerOptions, make_runner
from vlmbatch.vit_trt.compile_runner import CompiledRunner


def test_compiled_encoder_equals_eager(random_model_dir: Path) -> None:
    model = load_model(random_model_dir)
    runner = make_runner("compile", vision_model(model), RunnerOptions(max_batch=2))
    assert isinstance(runner, CompiledRunner) and "compile" in RUNNERS
    for n in (1, 3):  # bucket 1; then split into buckets 2 + 1 (no third compilation)
        tiles = torch.randint(0, 256, (n, 56, 56, 3), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            want = model.vision(tiles)
        got = runner.encode(tiles)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5
    assert runner.pool is not None and list(runner.pool.calls) == [1, 2, 1]
    assert not runner.pool.graphs  # no CUDA here: the pool calls the compiled function
