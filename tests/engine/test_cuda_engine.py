"""The whole torch engine on CUDA answers as on the CPU (GPU only; skipped without CUDA).

Built-in model, the examples' 12 images and 60 questions. fp32 on CUDA may differ from the CPU
by cuDNN's TF32 convolutions (the patch embedding) and kernel order, so margins are compared
with a tolerance; bf16 only has to give the same answers where the CPU's margin is clear.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.cli.run import load_items
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.jobs.config import RunConfig
from vlmbatch.pipeline.drive import answer_group

ROOT = Path(__file__).resolve().parents[2]
RUN = RunConfig(manifest=ROOT / "examples" / "manifest.jsonl",
                policy=ROOT / "examples" / "policy.yaml")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def answers(device: str, dtype: str = "float32", **engine: object) -> tuple[list[dict], object]:
    eng = build_engine(ModelConfig(device=device, dtype=dtype),
                       EngineConfig(vit_backend="torch", **engine))  # type: ignore[arg-type]
    return [a.line() for a in answer_group(eng, load_items(RUN))], eng


@pytest.fixture(scope="module")
def cpu() -> list[dict]:
    return answers("cpu")[0]


@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_on_cuda_matches_cpu(cpu: list[dict], graphs: bool) -> None:
    got, eng = answers("cuda", cuda_graphs=graphs)
    assert [g["error"] for g in got] == [None] * len(cpu)
    assert [g["answer"] for g in got] == [c["answer"] for c in cpu]
    worst = max(abs(g["margin"] - c["margin"]) for g, c in zip(got, cpu))
    assert worst <= 0.05, f"max |margin CUDA - CPU| {worst:.4f}"
    pool = eng.vision.pool
    assert (pool is not None and len(pool.graphs) > 0) == graphs
    # the engine reads the embeddings on their own stream: no host wait (the answers above
    # show the stream order suffices)
    assert pool is None or not pool.sync


def test_bf16_on_cuda_agrees_with_cpu(cpu: list[dict]) -> None:
    got, _ = answers("cuda", "bfloat16")
    clear = [(g, c) for g, c in zip(got, cpu) if abs(c["margin"]) > 1.0]
    assert len(clear) >= len(cpu) // 2
    assert all(g["answer"] == c["answer"] for g, c in clear)
    assert max(abs(g["p_yes"] - c["p_yes"]) for g, c in zip(got, cpu)) <= 0.1


def test_prefix_cache_on_cuda_changes_nothing() -> None:
    with_cache, eng = answers("cuda", prefix_cache=True)
    without, _ = answers("cuda", prefix_cache=False)
    assert eng.cache.stats.hit_rate() > 0.5
    assert max(abs(a["margin"] - b["margin"]) for a, b in zip(with_cache, without)) <= 1e-3


def test_cli_runs_on_cuda(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", str(RUN.manifest), "--policy", str(RUN.policy), "--device", "cuda",
                 "--dtype", "bfloat16", "--no-progress"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert out.count('"answer"') == 60
    assert "vision CUDA graphs: 7 batch sizes" in err  # buckets 1, 2, 4, 8, 16, 24, 32
