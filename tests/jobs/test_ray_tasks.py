"""Other models and tasks on Ray, trimmed for CI from the slow tests that check them
(``tests/cli/test_cli_qwen_vl.py::test_ray_gives_the_run_lines``,
``tests/jobs/test_embed_job.py::test_embed_job_on_ray`` and
``::test_kill_minus_9_then_resume_embeds_each_item_once``): a Qwen-VL checkpoint answered on
Ray, and an embedding job on Ray whose driver is killed with -9, then resumed. Each run is a
driver joined to the session's Ray head (``ray_head`` in ``tests/conftest.py``) by its GCS
address, in a subprocess (the head's token in its environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cli.test_cli_qwen_vl import run_lines
from tests.jobs.interrupting import assert_each_once, resume, stop_at
from tests.jobs.ray_head import RayHead
from tests.jobs.test_embed_job import stored, submit
from tests.jobs.test_job import ROOT, cli, make_manifest
from tests.models.qwen_vl_helpers import save_engine_checkpoint
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.jobs.folder import status

pytest.importorskip("ray")

RAY = ["--executor", "ray", "--model-cpus", "1"]


def test_qwen_vl_on_ray_gives_the_run_lines(ray_head: RayHead, tmp_path: Path) -> None:
    head = ray_head
    model = save_engine_checkpoint("qwen2_5_vl", tmp_path / "qwen")
    m = make_manifest(tmp_path, 2)
    direct = run_lines(m, model, tmp_path / "direct.jsonl")
    out = tmp_path / "ray.jsonl"
    p = subprocess.run([sys.executable, "-m", "vlmbatch", "run", str(m), "--model", str(model),
                        "--out", str(out), "--images-per-batch", "2", "--no-progress", *RAY,
                        "--address", head.address], cwd=ROOT, env=head.env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == EXIT_OK, p.stderr[-3000:]
    ray = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(a["id"], a["question_id"]) for a in ray] == \
        [(b["id"], b["question_id"]) for b in direct] and len(ray) == 4
    for a, b in zip(ray, direct):  # the actor's one torch thread: float noise only
        assert a["image_tokens"] == b["image_tokens"] and abs(a["p_yes"] - b["p_yes"]) <= 1e-5


def test_embed_job_on_ray_killed_with_minus_9_then_resumed(ray_head: RayHead, tmp_path: Path,
                                                           random_model_dir: Path) -> None:
    """The driver is SIGKILLed once the store holds 2 items (each model call slowed by
    0.5 s); resumed in-process, every item is embedded once, and the vectors (those made on
    Ray included) equal an in-process job's to 1e-5."""
    _, job = submit(tmp_path, random_model_dir, 6, "--images-per-batch", "1")
    p = cli("run", str(job), *RAY, "--address", ray_head.address, "--no-progress",
            env=ray_head.env, faults={"slow_score": 0.5})
    stop_at(p, job, 2)
    st = status(job)
    assert st.status == "interrupted" and 2 <= st.done < 7, st
    resume(job, rc=EXIT_ITEM_ERRORS)  # the missing image
    # one embedding per item, no more
    assert_each_once(job, ["i0", "t1", "b2", "i3", "t4", "b5", "gone"], per_item=1, failed=1)
    local = tmp_path / "local"
    local.mkdir()
    _, job2 = submit(local, random_model_dir, 6, "--images-per-batch", "1")
    assert main(["run", str(job2), "--no-progress"]) == EXIT_ITEM_ERRORS
    got, want = stored(job), stored(job2)
    assert [e.id for e in got] == [e.id for e in want] == ["i0", "t1", "b2", "i3", "t4", "b5",
                                                           "gone"]
    for a, b in zip(got, want):
        assert a.error_kind == b.error_kind
        if b.vector is not None:
            assert a.vector is not None and np.abs(a.vector - b.vector).max() <= 1e-5
