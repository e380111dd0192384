"""Long clips in windows and images asked one by one (issue 44): ``segment_seconds`` /
``segment_stride`` on a line and as run options, ``"per_image": true`` and
``vlmbatch.each_image``, through ``vlmbatch run``, ``submit``/``resume`` and the API, on
the built-in InternVL and Qwen2.5-VL models.

References: a window's answer is the engine asked directly about a clip made of that
window's frames alone (encoded here, prepared by ``VideoPlan.prepare``: the doors must hand
the engine that clip, its frames the family's rule over the window); an image's is the
engine asked about that image alone. The window bounds are written here by hand from the
rule (``docs/video.md``, "Windows"); the clip's line is the most probable window's, the
part lines read here. The shapes are drawn so that only window 2 (8-12 s) shows a red one,
and only the third image is red."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.preprocessing.video_clips import FFV1_MKV, make_clip
from vlmbatch.cli.main import main
from vlmbatch.engine.records import MediaItem, Request
from vlmbatch.inputs.manifest import read_manifest
from vlmbatch.jobs.store import image_item_from_json, image_item_to_json
from vlmbatch.labels.read import read_results
from vlmbatch.models.paths import DEFAULT_MODEL, DEFAULT_QWEN_MODEL
from vlmbatch.pipeline.media_inputs import ImageList, SamplingKeys, VideoInput
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.preprocessing.decode import decode
from vlmbatch.preprocessing.video_plan import checkpoint_video

RED, BLUE = "Is there a red shape?", "Is there a blue shape?"
MODELS = {"internvl": (DEFAULT_MODEL, "internvl"), "qwen": (DEFAULT_QWEN_MODEL, "qwen2_vl")}
RATE = 5  # fps of the clip: 80 frames, 16 s


def shape(rgb: tuple[int, int, int], k: int) -> np.ndarray:
    img = np.full((64, 64, 3), 255, np.uint8)
    cv2.circle(img, (32, 32), 13 + k % 4, rgb, -1)
    img[0, 0] = (k, 255 - k, k)  # every frame distinct (groups are keyed by content)
    return img


FRAMES = np.stack([shape((220, 30, 30) if 40 <= k < 60 else (30, 60, 220), k)
                   for k in range(80)])  # red only in 8-12 s


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("windows")
    (d / "clip.mkv").write_bytes(make_clip(FRAMES, FFV1_MKV, rate=RATE))
    for name, k in (("b0.png", 0), ("b1.png", 1), ("r.png", 45)):
        cv2.imwrite(str(d / name), FRAMES[k][:, :, ::-1])
    lines = [
        {"id": "clip", "video": "clip.mkv", "segment_seconds": 4, "questions": [RED, BLUE]},
        {"id": "half", "video": "clip.mkv", "questions": [RED, BLUE]},  # the run's options
        {"id": "each", "images": ["b0.png", "b1.png", "r.png"], "per_image": True,
         "questions": [RED, BLUE]},
        {"id": "still", "image": "r.png", "questions": [RED]},
    ]
    (d / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def run_lines(folder: Path, model: Path, out: Path, *more: str) -> list[dict]:
    assert main(["run", str(folder / "m.jsonl"), "--model", str(model), "--out", str(out),
                 "--dtype", "float32", "--no-progress", "--segment-seconds", "4",
                 "--segment-stride", "2", *more]) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


def of(lines: list[dict], item: str, question: str, parts: bool) -> list[dict]:
    return [x for x in lines if x["id"] == item and x["question"] == question
            and ("part" in x) == parts]


def check_reduced(lines: list[dict], item: str, question: str, tag: str) -> dict:
    """The item's line for ``question`` is the part of the highest p_yes (read from the part
    lines), naming it; returns it."""
    parts = of(lines, item, question, True)
    [whole] = of(lines, item, question, False)
    k = int(np.argmax([x["p_yes"] for x in parts]))
    assert [x["part"] for x in parts] == list(range(len(parts)))
    assert whole["parts"] == len(parts) and whole["trigger"] == k
    assert whole["p_yes"] == max(x["p_yes"] for x in parts)
    assert whole["answer"] == ("yes" if any(x["answer"] == "yes" for x in parts) else "no")
    assert whole[f"trigger_{tag}"] == parts[k][tag]
    for key in ("margin", "image_tokens", "frames", "seconds"):
        assert whole.get(key) == parts[k].get(key)
    return whole


@pytest.mark.parametrize("name", MODELS)
def test_windows_and_images_alone_answer_as_the_engine_does(folder: Path, tmp_path: Path,
                                                            name: str) -> None:
    from vlmbatch.engine.build import build_engine
    from vlmbatch.engine.config import EngineConfig, ModelConfig

    model, family = MODELS[name]
    lines = run_lines(folder, model, folder / f"out-{name}.jsonl")  # qwen's: resumed below
    # the line's window (4 s, its stride its own: 4 s) over the run's 4 s every 2 s
    red = of(lines, "clip", RED, True)
    assert [x["window"] for x in red] == [[0, 4], [4, 8], [8, 12], [12, 16]]
    assert [x["window"] for x in of(lines, "half", RED, True)] == [
        [s, s + 4] for s in range(0, 13, 2)]
    whole = check_reduced(lines, "clip", RED, "window")
    assert whole["trigger"] == 2 and whole["trigger_window"] == [8, 12]
    assert whole["answer"] == "yes" and [x["answer"] for x in red] == ["no", "no", "yes", "no"]
    assert check_reduced(lines, "clip", BLUE, "window")["trigger"] != 2
    assert check_reduced(lines, "half", RED, "window")["trigger_window"] in (
        [6, 10], [8, 12], [10, 14])
    each = check_reduced(lines, "each", RED, "image")
    assert each["trigger_image"] == 2 and each["answer"] == "yes"
    assert check_reduced(lines, "each", BLUE, "image")["trigger_image"] in (0, 1)
    [still] = [x for x in lines if x["id"] == "still"]
    assert not {"part", "parts", "trigger", "window", "frames"} & still.keys()

    engine = build_engine(ModelConfig(model, "cpu", "float32"), EngineConfig())
    plan = checkpoint_video(model, family)
    items = []
    for start in (0, 4, 8, 12):  # each window's frames alone, as their own clip
        alone = make_clip(FRAMES[start * RATE: (start + 4) * RATE], FFV1_MKV, rate=RATE)
        items.append(MediaItem((plan.prepare(alone, 10**9),)))  # type: ignore[arg-type]
    items += [engine.image_plan.prepare(decode((folder / f).read_bytes()))
              for f in ("b0.png", "b1.png", "r.png")]
    scores = engine.score(items, [Request(i, q) for i in range(7) for q in (RED, BLUE)])
    got = [x["p_yes"] for q in (RED, BLUE) for x in of(lines, "clip", q, True)]
    want = [s.p_yes for q in (0, 1) for s in scores[q: 8: 2]]
    assert got == pytest.approx(want, abs=2e-6)
    got = [x["p_yes"] for q in (RED, BLUE) for x in of(lines, "each", q, True)]
    want = [s.p_yes for q in (0, 1) for s in scores[8 + q:: 2]]
    assert got == pytest.approx(want, abs=2e-6)
    # eval, calibrate and report read one line per (item, question): the items' lines
    read = [(s.image_id, s.question_id) for s in read_results(folder / f"out-{name}.jsonl")]
    assert len(read) == len(set(read)) == 7


def test_submit_and_resume_keep_windows_and_images_alone(folder: Path,
                                                         tmp_path: Path) -> None:
    done = folder / "out-qwen.jsonl"  # the run above, else run here
    run = ([json.loads(x) for x in done.read_text().splitlines()] if done.exists()
           else run_lines(folder, DEFAULT_QWEN_MODEL, tmp_path / "o.jsonl"))
    job = tmp_path / "job"
    assert main(["submit", str(folder / "m.jsonl"), "--model", str(DEFAULT_QWEN_MODEL),
                 "--job", str(job), "--dtype", "float32", "--segment-seconds", "4",
                 "--segment-stride", "2"]) == 0
    assert main(["resume", str(job), "--no-progress"]) == 0
    assert main(["results", str(job), "--out", str(tmp_path / "r.jsonl")]) == 0
    got = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    key = lambda x: json.dumps(x, sort_keys=True)  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, run))
    read = [(s.image_id, s.question_id) for s in read_results(job)]
    assert len(read) == len(set(read)) == 7


@pytest.mark.parametrize("name, groups", [("internvl", 32), ("qwen", 16)])
def test_half_overlapping_windows_encode_each_group_once(folder: Path, name: str,
                                                         groups: int) -> None:
    """16 s at 5 fps, sampled at 2 fps in windows of 4 s every 2 s: 7 windows of 8 of
    their 20 frames, one every 2.5 (InternVL ``arange(1.25, 20, 2.5)``: 1, 3, 6, 8, ...;
    Qwen ``arange(0, 20, 2.5)``: 0, 2, 5, 7, ...), so a window's second half is the next
    one's first: 8 + 6 x 4 = 32 frames seen, InternVL 32 groups (a frame each), Qwen 16
    (2 frames each). The tower sees exactly those, with two questions per window."""
    import vlmbatch

    with vlmbatch.VLM(MODELS[name][0], dtype="float32", decode_timeout=0) as vlm:
        runner = vlm.engine.runner  # type: ignore[attr-defined]
        seen: list[int] = []
        encode = runner.encode_images
        runner.encode_images = lambda ims: (seen.append(len(ims)), encode(ims))[1]
        got = list(vlm.ask([vlmbatch.video(folder / "clip.mkv", fps=2, segment_seconds=4,
                                           segment_stride=2)], [RED, BLUE]))
        assert runner.features.encoded == sum(seen) == groups
    assert sum(a.part is not None for a in got) == 14 and got[-1].parts == 7
    whole = [a for a in got if a.parts]
    assert whole[0].trigger_window in ((8.0, 12.0), (6.0, 10.0), (10.0, 14.0))


def test_the_api_asks_each_image_alone(folder: Path) -> None:
    import vlmbatch

    with vlmbatch.VLM(vlmbatch.QWEN_MODEL, decode_timeout=0) as vlm:
        got = list(vlm.ask([vlmbatch.each_image([folder / "b0.png", folder / "b1.png",
                                                 folder / "r.png"])], [RED]))
        alone = list(vlm.ask([folder / "b0.png", folder / "b1.png", folder / "r.png"], [RED]))
    assert [a.image for a in got[:3]] == [0, 1, 2] and got[3].trigger_image == 2
    assert [a.p_yes for a in got[:3]] == [a.p_yes for a in alone]
    assert got[3].p_yes == max(a.p_yes for a in alone) and got[3].answer == "yes"


def test_manifest_keys_and_store_of_windows(tmp_path: Path) -> None:
    def read(*lines: dict) -> list:
        m = tmp_path / "m.jsonl"
        m.write_text("".join(json.dumps({"questions": [RED], **x}) + "\n" for x in lines))
        return read_manifest(m)

    a, b = read({"id": "a", "images": ["x.png", "y.png"], "per_image": True},
                {"id": "b", "video": "c.mkv", "segment_seconds": 8, "segment_stride": 4})
    assert a.image == ImageList(("x.png", "y.png"), per_image=True)
    assert b.image == VideoInput("c.mkv", SamplingKeys(segment_seconds=8.0,
                                                       segment_stride=4.0))
    for it in (a, b):
        back = image_item_from_json(image_item_to_json(it))
        assert back.image == it.image
    for line, message in (
            ({"image": "x.png", "per_image": True}, "'per_image'.*goes with 'images'"),
            ({"images": ["x.png"], "per_image": 1}, "'per_image'"),
            ({"image": "x.png", "segment_seconds": 4}, "sample a clip: give 'video'"),
            ({"video": "c.mkv", "segment_stride": 2}, "segment_stride needs segment_seconds"),
            ({"video": "c.mkv", "segment_seconds": 0}, "segment_seconds must be a number"),
            ({"video": "c.mkv", "segment_seconds": 4, "segment_stride": "2"},
             "segment_stride must be a number")):
        with pytest.raises(ManifestError, match=message):
            read(line)
    assert main(["run", str(tmp_path / "m.jsonl"), "--segment-seconds", "-1",
                 "--out", str(tmp_path / "o.jsonl")]) != 0
