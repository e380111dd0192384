"""Issue 44's bad-input list through ``vlmbatch run``: one manifest holding every bad clip
beside good ones, one run (decoder processes under the decode deadline, as by default):
each bad item its error with its kind and a message naming the limit or the fault, every
other item answered, nothing hanging. Clips are made here (``tests/preprocessing/
video_clips.py``; the broken ones as ``test_video_decode.py`` makes them). docs/reliability.md's
"Bad clips in one run" table is this test's.

Where a clip is answered, what the model saw is checked against an independent fact: the
rotated clip's answer equals that of a clip whose frames were drawn already turned (the
display matrix applied); the variable-frame-rate clip's seconds are the times it was written
with; a clip under a token budget has the frames transformers' InternVL rule gives for the
capped count (written by hand)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.preprocessing.test_video_decode import audio_clip, truncated, unknown_codec
from tests.preprocessing.video_clips import FFV1_MKV, X264_MP4, frames, make_clip
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main
from vlmbatch.jobs.config import from_json
from vlmbatch.jobs.folder import load_config
from vlmbatch.pipeline.media_inputs import MAX_IMAGES

Q = "Is there a red shape?"
# kind and a piece of the message each bad line must get
BAD = {
    "truncated_mkv": ("decode", "truncated"),
    "truncated_mp4": ("decode", "not a readable video"),  # cut before its index (moov)
    "no_video_stream": ("decode", "no video stream (streams: audio)"),
    "zero_frames": ("decode", "video stream has no frames"),
    "text_named_mp4": ("decode", "not a readable video"),
    "unsupported_codec": ("decode", "cannot be decoded by this FFmpeg"),
    "8k_frames": ("too_large", "7680x4320 = 33,177,600 pixels, over the limit of 8,294,400 "
                               "per frame (raise --max-pixels"),
    "too_long": ("too_large", "12.0 s long, over the limit of 10 s (raise "
                              "--max-video-seconds"),
    "over_budget": ("too_large", "one frame is 16 visual tokens, over the budget of 10"),
    "over_context": ("too_large", "over the model's context of 4,096"),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("limits")
    px = frames(8, 64, 48)
    write = {
        "good.mkv": make_clip(px, FFV1_MKV),
        "truncated.mkv": truncated(FFV1_MKV),
        "truncated.mp4": truncated(X264_MP4),
        "audio.mkv": audio_clip(video_track=False),
        "zero.mkv": audio_clip(video_track=True),
        "text.mp4": b"hello, this is not a video\n" * 20,
        "codec.mkv": unknown_codec(),
        "rotated.mp4": make_clip(px, X264_MP4, rotation=90),
        "upright.mp4": make_clip(np.ascontiguousarray(np.rot90(px, 1, axes=(1, 2))), X264_MP4),
        # 0, 0.1, 0.5, 0.6, 1.5, 1.6, 1.7, 3.0 s: variable frame rate
        "vfr.mkv": make_clip(px, FFV1_MKV, pts=[0, 100, 500, 600, 1500, 1600, 1700, 3000],
                             time_base=Fraction(1, 1000)),
        "8k.mkv": make_clip(np.zeros((1, 4320, 7680, 3), np.uint8),
                            ("matroska", "libx264", "yuv420p", {"preset": "ultrafast"})),
        "long.mkv": make_clip(frames(12, 32, 32), FFV1_MKV, rate=1),  # 12 s
        "many.mkv": make_clip(frames(250, 16, 16), FFV1_MKV),
    }
    for name, data in write.items():
        (d / name).write_bytes(data)
    lines = [
        {"id": "good", "video": "good.mkv", "num_frames": 4},
        {"id": "truncated_mkv", "video": "truncated.mkv", "num_frames": 2},
        {"id": "truncated_mp4", "video": "truncated.mp4", "num_frames": 2},
        {"id": "no_video_stream", "video": "audio.mkv"},
        {"id": "zero_frames", "video": "zero.mkv"},
        {"id": "text_named_mp4", "video": "text.mp4"},
        {"id": "unsupported_codec", "video": "codec.mkv", "num_frames": 2},
        {"id": "rotated", "video": "rotated.mp4", "num_frames": 4},
        {"id": "upright", "video": "upright.mp4", "num_frames": 4},
        {"id": "vfr", "video": "vfr.mkv", "num_frames": 4},
        {"id": "8k_frames", "video": "8k.mkv", "num_frames": 1},
        {"id": "too_long", "video": "long.mkv", "num_frames": 2},
        {"id": "budget", "video": "good.mkv", "num_frames": 8, "max_video_tokens": 50},
        {"id": "over_budget", "video": "good.mkv", "num_frames": 4, "max_video_tokens": 10},
        # 250 frames x 16 tokens fit the context of 4,096; with their "FrameN: " lines and
        # the question they do not
        {"id": "over_context", "video": "many.mkv", "num_frames": 250},
        {"id": "still", "image": "good.png"},
    ]
    cv2.imwrite(str(d / "good.png"), px[0][:, :, ::-1])
    (d / "m.jsonl").write_text("".join(json.dumps({**x, "questions": [Q]}) + "\n"
                                       for x in lines))
    return d


def lines_of(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.timeout(120)
def test_one_run_over_every_bad_clip(folder: Path) -> None:
    out = folder / "out.jsonl"
    rc = main(["run", str(folder / "m.jsonl"), "--out", str(out), "--dtype", "float32",
               "--no-progress", "--max-pixels", str(3840 * 2160), "--max-video-seconds", "10",
               "--decode-timeout", "60"])
    assert rc == EXIT_ITEM_ERRORS
    got = lines_of(out)
    assert len(got) == 16
    for name, (kind, message) in BAD.items():
        assert got[name]["error_kind"] == kind and got[name]["p_yes"] is None, got[name]
        assert message in got[name]["error"], got[name]["error"]
    answered = set(got) - set(BAD)
    assert answered == {"good", "rotated", "upright", "vfr", "budget", "still"}
    for name in answered:
        assert got[name]["error"] is None and 0 <= got[name]["p_yes"] <= 1, got[name]
    # InternVL's middle of 4 segments of 8 frames at 25 fps: arange(1, 8, 2)
    assert got["good"]["seconds"] == [0.04, 0.12, 0.2, 0.28]
    # the display matrix applied: the model sees the frames as drawn turned
    assert got["rotated"]["p_yes"] == got["upright"]["p_yes"]
    assert got["rotated"]["margin"] == got["upright"]["margin"]
    assert got["rotated"]["margin"] != got["good"]["margin"]  # its frames unturned: not seen
    # frames 1, 3, 5, 7 of the variable-rate clip, at the times they were written with
    assert got["vfr"]["seconds"] == [0.1, 0.6, 1.6, 3.0]
    # 50 tokens hold 3 frames of 16: transformers' rule for 3 of 8, arange(4/3, 8, 8/3)
    # truncated: 1, 4, 6
    assert got["budget"]["frames"] == 3 and got["budget"]["seconds"] == [0.04, 0.16, 0.24]
    assert "frames" not in got["still"]


def test_image_lists_out_of_bounds_are_their_items_errors(folder: Path, tmp_path: Path) -> None:
    """An empty ``images`` list and 1,000 images in one item are each that item's error (the
    limit stated), before any of its images is read; the rest of the run is answered, by
    ``run`` and by a job (``submit`` + ``resume``)."""
    (tmp_path / "good.mkv").write_bytes((folder / "good.mkv").read_bytes())
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(x) + "\n" for x in (
        {"id": "a", "video": "good.mkv", "questions": [Q]},
        {"id": "empty", "images": [], "questions": [Q]},
        {"id": "many", "images": ["nowhere.png"] * 1000, "questions": [Q]})))
    for how in ("run", "job"):
        out = tmp_path / f"{how}.jsonl"
        if how == "run":
            assert main(["run", str(m), "--out", str(out), "--no-progress"]) == EXIT_ITEM_ERRORS
        else:
            job = tmp_path / "job"
            assert main(["submit", str(m), "--job", str(job)]) == 0
            assert main(["resume", str(job), "--no-progress"]) == EXIT_ITEM_ERRORS
            assert main(["results", str(job), "--out", str(out)]) == 0
        got = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
        assert got["a"]["error"] is None and got["a"]["frames"] > 0
        assert got["empty"]["error_kind"] == "source"
        assert "'images' is empty" in got["empty"]["error"]
        assert got["many"]["error_kind"] == "too_large"  # not "source": no image was read
        assert f"1000 images in one item, over the limit of {MAX_IMAGES}" in got["many"]["error"]


def test_a_job_keeps_its_video_limit(folder: Path, tmp_path: Path) -> None:
    """--max-video-seconds is stored in job.json: a resumed job refuses as submitted; a
    job.json from before the option reads the default (an hour)."""
    job = tmp_path / "job"
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"id": "long", "video": str(folder / "long.mkv"), "num_frames": 2,
                             "questions": [Q]}) + "\n")
    assert main(["submit", str(m), "--job", str(job), "--max-video-seconds", "10"]) == 0
    assert load_config(job).prepare.max_video_seconds == 10
    assert main(["resume", str(job), "--no-progress"]) == EXIT_ITEM_ERRORS
    assert main(["results", str(job), "--out", str(tmp_path / "r.jsonl")]) == 0
    r = lines_of(tmp_path / "r.jsonl")["long"]
    assert r["error_kind"] == "too_large" and "over the limit of 10 s" in r["error"]
    body = json.loads((job / "job.json").read_text())["config"]
    del body["prepare"]["max_video_seconds"]
    from vlmbatch.jobs.config import RunConfig

    assert from_json(RunConfig, body).prepare.max_video_seconds == 3600.0


def test_the_api_takes_the_limits(folder: Path) -> None:
    import vlmbatch

    with vlmbatch.VLM(decode_timeout=0, max_video_seconds=10, max_video_tokens=50) as vlm:
        long, budget, own = vlm.ask([vlmbatch.video(folder / "long.mkv", num_frames=2),
                                     vlmbatch.video(folder / "good.mkv", num_frames=8),
                                     vlmbatch.video(folder / "good.mkv", num_frames=8,
                                                    max_video_tokens=100)], [Q])
    assert long.error_kind == "too_large" and "over the limit of 10 s" in (long.error or "")
    assert budget.frames == 3 and own.frames == 6  # the run's budget; the clip's own wins


def test_a_qwen_clip_under_a_budget_keeps_its_frames(folder: Path, tmp_path: Path) -> None:
    """Qwen2.5-VL: the budget makes the frames smaller, never fewer; a job keeps a run's
    --max-video-tokens in its items (folded in at submit, as --fps is)."""
    import vlmbatch

    with vlmbatch.VLM(vlmbatch.QWEN_MODEL, decode_timeout=0) as vlm:
        free, small = vlm.ask([vlmbatch.video(folder / "good.mkv", num_frames=4),
                               vlmbatch.video(folder / "good.mkv", num_frames=4,
                                              max_video_tokens=10)], [Q])
    assert free.seconds == small.seconds and free.frames == small.frames == 4
    # 64x48 frames: the checkpoint's min_pixels (12,544) enlarges them to 140x112, 2 temporal
    # patches x 4 x 5 merged = 40 tokens; under 10, the stated bound 5 x 28^2 per frame gives
    # 84x56 with the floor at the bound (rounded up: 12 tokens), 56x56 without: 2 x 2 x 2 = 8
    assert (free.image_tokens, small.image_tokens) == (40, 8)
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"id": "c", "video": str(folder / "good.mkv"), "num_frames": 4,
                             "questions": [Q]}) + "\n")
    job = tmp_path / "job"
    assert main(["submit", str(m), "--model", str(vlmbatch.QWEN_MODEL), "--job", str(job),
                 "--max-video-tokens", "10"]) == 0
    assert main(["resume", str(job), "--no-progress"]) == 0
    assert main(["results", str(job), "--out", str(tmp_path / "r.jsonl")]) == 0
    r = lines_of(tmp_path / "r.jsonl")["c"]
    assert r["image_tokens"] == small.image_tokens and r["p_yes"] == small.p_yes
