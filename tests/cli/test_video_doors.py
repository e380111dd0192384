"""Clips and image lists through the doors (issue 44): manifest lines (``images``, ``video``
and its sampling keys, the run's ``--fps``...), ``vlmbatch run`` and ``submit``/``resume``,
the Python API; on the built-in InternVL and Qwen models, with clips made here (lossless,
``tests/preprocessing/video_clips.py``).

The reference for an answer is the engine itself asked directly (``Engine.score`` on a
``MediaItem`` made from the clip by ``VideoPlan.prepare``, whose margins equal transformers'
in ``tests/engine/test_media_engine.py``): the doors must hand the engine that item. The
frames a line says the model saw are computed here by hand from transformers' rules
(``docs/video.md``), not read from the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main
from vlmbatch.engine.records import MediaItem, Request
from vlmbatch.inputs.manifest import read_manifest
from vlmbatch.jobs.store import image_item_from_json, image_item_to_json
from vlmbatch.models.paths import DEFAULT_MODEL, DEFAULT_QWEN_MODEL
from vlmbatch.pipeline.media_inputs import MAX_IMAGES, ImageList, SamplingKeys, VideoInput
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.preprocessing.decode import decode
from vlmbatch.preprocessing.video_plan import checkpoint_video

Q = "Is there a red shape?"
MODELS = {"internvl": (DEFAULT_MODEL, "internvl"), "qwen": (DEFAULT_QWEN_MODEL, "qwen2_vl")}


def png(path: Path, seed: int) -> np.ndarray:
    img = np.random.default_rng(seed).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    cv2.imwrite(str(path), img[:, :, ::-1])
    return img


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("doors")
    (d / "clip.mkv").write_bytes(make_clip(frames(20, 64, 48), FFV1_MKV))  # 25 fps, 0.8 s
    png(d / "a.png", 1)
    png(d / "b.png", 2)
    data = (d / "clip.mkv").read_bytes()
    (d / "trunc.mkv").write_bytes(data[: len(data) // 3])
    (d / "text.mp4").write_text("not a clip")
    lines = [
        {"id": "clip", "video": "clip.mkv", "num_frames": 4, "questions": [Q]},
        {"id": "pair", "images": ["a.png", "b.png"], "questions": [Q]},
        {"id": "still", "image": "a.png", "questions": [Q]},
        {"id": "trunc", "video": "trunc.mkv", "questions": [Q]},
        {"id": "text", "video": "text.mp4", "questions": [Q]},
        {"id": "gone", "video": "nope.mkv", "questions": [Q]},
        {"id": "long", "video": "clip.mkv", "num_frames": 40, "questions": [Q]},
    ]
    (d / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def lines_of(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("name", MODELS)
def test_run_answers_clips_and_lists_as_the_engine_does(folder: Path, name: str) -> None:
    from vlmbatch.engine.build import build_engine
    from vlmbatch.engine.config import EngineConfig, ModelConfig

    model, family = MODELS[name]
    out = folder / f"out-{name}.jsonl"
    rc = main(["run", str(folder / "m.jsonl"), "--model", str(model), "--out", str(out),
               "--dtype", "float32", "--no-progress"])
    assert rc == EXIT_ITEM_ERRORS
    got = lines_of(out)
    # transformers' rules for 4 of 20 frames: Qwen2.5-VL arange(0, 20, 5); InternVL the
    # middle of 4 segments, arange(2.5, 20, 5) truncated
    idx = [0, 5, 10, 15] if family == "qwen2_vl" else [2, 7, 12, 17]
    assert got["clip"]["frames"] == 4
    assert got["clip"]["seconds"] == [i / 25 for i in idx]
    assert "frames" not in got["pair"] and "frames" not in got["still"]
    for bad in ("trunc", "text", "long"):
        assert got[bad]["error_kind"] == "decode" and got[bad]["p_yes"] is None, got[bad]
    assert got["gone"]["error_kind"] == "source" and "nope.mkv" in got["gone"]["error"]
    assert "frames" not in got["trunc"]

    engine = build_engine(ModelConfig(model, "cpu", "float32"), EngineConfig())
    clip = checkpoint_video(model, family).with_sampling(num_frames=4).prepare(
        (folder / "clip.mkv").read_bytes(), 10**9)
    assert list(clip.frame_indices) == idx
    plan = engine.image_plan
    a, b = (plan.prepare(decode((folder / f).read_bytes())) for f in ("a.png", "b.png"))
    items = [MediaItem((clip,)), MediaItem((a, b)), MediaItem((b, a))]
    s = engine.score(items, [Request(i, Q) for i in range(3)])  # type: ignore[arg-type]
    assert got["clip"]["p_yes"] == pytest.approx(s[0].p_yes, abs=2e-6)
    assert got["pair"]["p_yes"] == pytest.approx(s[1].p_yes, abs=2e-6)
    assert abs(s[1].margin - s[2].margin) > 1e-4  # the order of the images reaches the model


def test_run_options_sample_where_a_line_gives_none(folder: Path, tmp_path: Path) -> None:
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"id": "c", "video": str(folder / "clip.mkv"), "questions": [Q]})
                 + "\n" + json.dumps({"id": "d", "video": str(folder / "clip.mkv"),
                                      "fps": 5, "questions": [Q]}) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["run", str(m), "--model", str(DEFAULT_QWEN_MODEL), "--out", str(out),
                 "--num-frames", "2", "--no-progress"]) == 0
    got = lines_of(out)
    assert got["c"]["seconds"] == [0.0, 0.4]  # arange(0, 20, 10)
    # the line's fps wins: 20 frames / 25 fps * 5 = 4 frames, arange(0, 20, 5)
    assert got["d"]["seconds"] == [0.0, 0.2, 0.4, 0.6]
    job = tmp_path / "job"  # a job keeps the run's keys (in its items) for a later run
    assert main(["submit", str(m), "--model", str(DEFAULT_QWEN_MODEL), "--job", str(job),
                 "--num-frames", "2"]) == 0
    assert main(["run", str(job), "--no-progress"]) == 0
    assert main(["results", str(job), "--out", str(tmp_path / "r.jsonl")]) == 0
    assert lines_of(tmp_path / "r.jsonl") == got


def test_submit_and_resume_keep_clips_and_lists(folder: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    assert main(["submit", str(folder / "m.jsonl"), "--model", str(DEFAULT_QWEN_MODEL),
                 "--job", str(job), "--dtype", "float32"]) == 0
    assert main(["resume", str(job), "--no-progress"]) == EXIT_ITEM_ERRORS
    assert main(["results", str(job), "--out", str(tmp_path / "r.jsonl")]) == 0
    got = lines_of(tmp_path / "r.jsonl")
    run = lines_of(folder / "out-qwen.jsonl") if (folder / "out-qwen.jsonl").exists() else None
    assert got["clip"]["frames"] == 4 and got["clip"]["seconds"] == [0.0, 0.2, 0.4, 0.6]
    assert got["text"]["error_kind"] == "decode"
    if run is not None:
        assert got["pair"]["p_yes"] == run["pair"]["p_yes"]


def test_the_api_takes_lists_and_clips(folder: Path) -> None:
    import vlmbatch

    with vlmbatch.VLM(vlmbatch.QWEN_MODEL, decode_timeout=0) as vlm:  # threads, not processes
        got = list(vlm.ask([[folder / "a.png", folder / "b.png"],
                            vlmbatch.video(folder / "clip.mkv", num_frames=4),
                            str(folder / "a.png")], [Q]))
        pair = list(vlm.ask_many([ImageItem("p", [str(folder / "a.png"),
                                                  str(folder / "b.png")], [Q])]))
    assert [a.image_id for a in got] == ["0", "1", "2"]
    assert got[0].frames is None and got[2].frames is None
    assert got[1].frames == 4 and got[1].seconds == (0.0, 0.2, 0.4, 0.6)
    assert pair[0].p_yes == got[0].p_yes and got[0].error is None
    with pytest.raises(ValueError, match="fps or num_frames"):
        vlmbatch.video("c.mkv", fps=2, num_frames=4)


def test_manifest_lines_with_lists_and_clips(tmp_path: Path) -> None:
    def read(*lines: dict) -> list[ImageItem]:
        m = tmp_path / "m.jsonl"
        m.write_text("".join(json.dumps({"questions": [Q], **x}) + "\n" for x in lines))
        return read_manifest(m)

    a, b = read({"id": "a", "images": ["x.png", "y.png"]},
                {"id": "b", "video": "c.mkv", "fps": 2, "max_frames": 8})
    assert a.image == ImageList(("x.png", "y.png"))
    assert b.image == VideoInput("c.mkv", SamplingKeys(2.0, None, 8))
    for line, message in (
            ({"images": "x.png"}, r":1: 'images' must be a list"),
            ({"images": ["x.png", 3]}, r"images\[1\] must be a path"),
            ({"video": "c.mkv", "fps": 2, "num_frames": 4}, "fps or num_frames, not both"),
            ({"video": "c.mkv", "fps": -1}, "fps must be a number > 0"),
            ({"video": "c.mkv", "num_frames": 2.5}, "num_frames must be a whole number"),
            ({"image": "x.png", "fps": 2}, "sample a clip: give 'video'"),
            ({"image": "x.png", "video": "c.mkv"}, "give one of image / video"),
            ({"video": "c.mkv", "frames": 4}, "unknown key"),
            ({}, "missing 'image'")):
        with pytest.raises(ManifestError, match=message):
            read(line)
    assert main(["run", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "o.jsonl")]) \
        == EXIT_BAD_INPUT  # the last line read: through run, before any work
    # a list's count is not the line's fault but its item's (tests/cli/test_video_limits.py)
    assert read({"id": "e", "images": []})[0].image == ImageList(())
    assert len(read({"id": "m", "images": ["x.png"] * (MAX_IMAGES + 1)})[0].image.images) == 65


def test_a_job_store_keeps_lists_and_clips(tmp_path: Path) -> None:
    items = [ImageItem("a", ["x.png", "y.png"], [Q], tmp_path),
             ImageItem("b", VideoInput("c.mkv", SamplingKeys(None, 4, None)), [Q], tmp_path),
             ImageItem("c", "x.png", [Q], tmp_path)]
    for it in items:
        back = image_item_from_json(image_item_to_json(it))
        assert back.image == it.image and back.questions == it.questions
    old = json.dumps({"id": "c", "image": "x.png", "base_dir": str(tmp_path),
                      "questions": [["q0", Q, 0.5]]})  # a store from before clips
    assert image_item_to_json(image_item_from_json(old)) == image_item_to_json(items[2])
