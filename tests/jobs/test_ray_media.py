"""Clips and image lists through ``--executor ray`` (issue 44): a manifest with a clip, a clip
sampled by the run's ``--num-frames``, a pair, a list and a clip read over HTTP, a list and a
clip whose remote part times out under the run's ``--fetch-timeout``, and a bad clip gives on
Ray the lines the local executor gives (P(yes) within 2e-6, ``frames``/``seconds`` equal, each
failure its item's error with the same kind). The frames expected are written here by hand
from transformers' InternVL rule (the middle of each of n equal segments), not read from the
code under test. The run on Ray is a driver of its own joined to the session's Ray head
(``ray_head`` in ``tests/conftest.py``), the HTTP server a real one on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.jobs.ray_head import RayHead
from tests.jobs.test_job import cli
from tests.loopback import LoopbackServer
from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main

pytest.importorskip("ray")

Q = "Is there a red shape?"
# the run's options: --num-frames reaches the clip whose line gives no keys; a remote part
# slower than --fetch-timeout fails (the default timeout would wait for it)
RUN = ["--num-frames", "2", "--fetch-timeout", "1", "--fetch-retries", "0",
       "--images-per-batch", "3", "--no-progress"]


@pytest.fixture(scope="module")
def loopback() -> LoopbackServer:
    with LoopbackServer() as server:
        yield server


def manifest(d: Path, server: LoopbackServer) -> Path:
    clip = make_clip(frames(20, 64, 48), FFV1_MKV)  # 25 fps, 0.8 s
    (d / "clip.mkv").write_bytes(clip)
    (d / "text.mp4").write_text("not a clip")
    for name, seed in (("a.png", 1), ("b.png", 2)):
        img = np.random.default_rng(seed).integers(0, 256, (60, 90, 3), dtype=np.uint8)
        cv2.imwrite(str(d / name), img)
        server.files[name] = (d / name).read_bytes()
    server.files["clip.mkv"] = clip
    lines = [
        {"id": "clip", "video": "clip.mkv", "num_frames": 4, "questions": [Q, "A circle?"]},
        {"id": "run_keys", "video": "clip.mkv", "questions": [Q]},
        {"id": "pair", "images": ["a.png", "b.png"], "questions": [Q]},
        {"id": "remote_pair", "images": ["a.png", server.url("/img/b.png")], "questions": [Q]},
        {"id": "remote_clip", "video": server.url("/img/clip.mkv"), "num_frames": 4,
         "questions": [Q]},
        {"id": "slow_pair", "images": ["a.png", server.url("/slow/4000/b.png")],
         "questions": [Q]},
        {"id": "slow_clip", "video": server.url("/slow/4000/clip.mkv"), "questions": [Q]},
        {"id": "bad_clip", "video": "text.mp4", "questions": [Q]},
    ]
    (d / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d / "m.jsonl"


def by_id(path: Path) -> dict[tuple[str, str], dict]:
    return {(r["id"], r["question_id"]): r
            for r in map(json.loads, path.read_text().splitlines())}


def test_ray_answers_clips_and_lists_as_the_local_executor(
        tmp_path: Path, random_model_dir: Path, ray_head: RayHead,
        loopback: LoopbackServer) -> None:
    m = manifest(tmp_path, loopback)
    model = ["--model", str(random_model_dir)]
    local = tmp_path / "local.jsonl"
    assert main(["run", str(m), "-o", str(local), *model, *RUN]) == EXIT_ITEM_ERRORS
    out = tmp_path / "ray.jsonl"
    p = cli("run", str(m), "-o", str(out), *model, *RUN, "--executor", "ray",
            "--model-cpus", "1", "--address", ray_head.address, env=ray_head.env)
    _, err = p.communicate(timeout=300)
    assert p.returncode == EXIT_ITEM_ERRORS, err[-3000:]
    want, got = by_id(local), by_id(out)
    assert list(got) == list(want) and len(got) == 9  # same lines, same order

    # InternVL's rule: one frame from the middle of each of n equal segments of 20 frames
    assert want["clip", "q0"]["seconds"] == [i / 25 for i in (2, 7, 12, 17)]
    assert want["run_keys", "q0"]["seconds"] == [i / 25 for i in (5, 15)]  # --num-frames 2
    assert want["remote_clip", "q0"]["seconds"] == want["clip", "q0"]["seconds"]
    for k in ("pair", "remote_pair", "clip", "run_keys", "remote_clip"):
        assert want[k, "q0"]["error"] is None, want[k, "q0"]
    assert want["remote_pair", "q0"]["p_yes"] == pytest.approx(want["pair", "q0"]["p_yes"],
                                                               abs=2e-6)
    for k in ("slow_pair", "slow_clip"):
        assert want[k, "q0"]["error_kind"] == "source", want[k, "q0"]
    assert want["bad_clip", "q0"]["error_kind"] == "decode"

    for key, w in want.items():
        g = got[key]
        assert {k: v for k, v in g.items() if k not in ("p_yes", "margin")} == \
            {k: v for k, v in w.items() if k not in ("p_yes", "margin")}, key
        if w["p_yes"] is not None:
            assert abs(g["p_yes"] - w["p_yes"]) <= 2e-6, key
            assert abs(g["margin"] - w["margin"]) <= 2e-4, key


@pytest.mark.slow  # ~15 s more: CI's test above runs `run MANIFEST --executor ray`, a job too
def test_submit_then_resume_on_ray_keeps_the_runs_keys(
        tmp_path: Path, random_model_dir: Path, ray_head: RayHead,
        loopback: LoopbackServer) -> None:
    """``submit --num-frames 2`` folds the key into the job's items; ``resume --executor ray``
    answers them as a local ``run`` of the manifest with the same options does."""
    m = manifest(tmp_path, loopback)
    local = tmp_path / "local.jsonl"
    assert main(["run", str(m), "-o", str(local), "--model", str(random_model_dir), *RUN]) \
        == EXIT_ITEM_ERRORS
    job = tmp_path / "job"
    assert main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir),
                 "--num-frames", "2", "--images-per-batch", "3"]) == 0
    p = cli("resume", str(job), "--fetch-timeout", "1", "--fetch-retries", "0",
            "--no-progress", "--executor", "ray", "--model-cpus", "1",
            "--address", ray_head.address, env=ray_head.env)
    _, err = p.communicate(timeout=300)
    assert p.returncode == EXIT_ITEM_ERRORS, err[-3000:]
    out = tmp_path / "r.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == 0
    want, got = by_id(local), by_id(out)
    assert list(got) == list(want)
    assert got["run_keys", "q0"]["seconds"] == [i / 25 for i in (5, 15)]
    for key, w in want.items():
        g = got[key]
        assert {k: v for k, v in g.items() if k not in ("p_yes", "margin")} == \
            {k: v for k, v in w.items() if k not in ("p_yes", "margin")}, key
        if w["p_yes"] is not None:
            assert abs(g["p_yes"] - w["p_yes"]) <= 2e-6, key


def test_a_prepare_tasks_deadline_counts_each_image_and_clip(tmp_path: Path) -> None:
    """A prepare task's deadline is ``--decode-timeout`` per image and per clip: a list of
    3, a clip and a still image, 5 x 2 s (Ray faked: ``RayStages``' scheduler alone, the
    task run at once on files that are not there, so that only the deadline is measured)."""
    import pickle
    import time

    from tests.jobs.test_ray_executor import _FakeRay
    from vlmbatch.jobs.config import RunConfig
    from vlmbatch.jobs.ray_executor import _Scheduler
    from vlmbatch.models.paths import DEFAULT_MODEL
    from vlmbatch.pipeline.config import PrepareConfig
    from vlmbatch.pipeline.hooks import NO_HOOKS
    from vlmbatch.pipeline.media_inputs import VideoInput
    from vlmbatch.pipeline.records import ImageItem
    from vlmbatch.pipeline.task import AnswerTask
    from vlmbatch.preprocessing.prepare import TilingConfig
    from vlmbatch.preprocessing.video_plan import checkpoint_video

    items = [ImageItem("list", ["x.png", "y.png", "z.png"], [Q], tmp_path),
             ImageItem("clip", VideoInput("c.mkv"), [Q], tmp_path),
             ImageItem("still", "x.png", [Q], tmp_path)]
    cfg = RunConfig(manifest=tmp_path / "m.jsonl", prepare=PrepareConfig(decode_timeout=2.0))
    plan = checkpoint_video(DEFAULT_MODEL, "internvl")
    s = _Scheduler(_FakeRay(0), cfg, AnswerTask(plan), [], TilingConfig(tile_size=56),
                   NO_HOOKS, iter([]))
    t0 = time.monotonic()
    s._submit_prepare(items)
    t1 = time.monotonic()
    ((_, deadline, _),) = s.preparing.values()
    assert t0 + 5 * 2.0 <= deadline <= t1 + 5 * 2.0
    # a group without a clip is sent the task without the plan: unpickling it in a prepare
    # worker imports no clip decoder (PyAV)
    assert b"video_plan" in pickle.dumps(s.task) and b"video_plan" not in pickle.dumps(s.stills)
