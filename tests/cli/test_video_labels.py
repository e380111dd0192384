"""Clips and image lists through ``eval``, ``calibrate``, ``report`` and the CSV and Parquet
results (issue 44), on the built-in model, with clips made here (lossless FFV1,
``tests/preprocessing/video_clips.py``):

- ``eval MANIFEST`` over ``video`` and ``images`` lines scores exactly ``run``'s lines of the
  same manifest (its metrics equal those of ``run``'s file joined with the labels), a clip
  that fails counted apart; ``calibrate`` takes such a manifest as its labels;
- ``report`` shows a clip as a strip of the frames the model saw and a list as its images,
  and neither ``report`` on a job without clips nor ``calibrate`` imports PyAV or OpenCV
  (the same check sees PyAV imported for a job with a clip);
- CSV and Parquet results carry ``frames`` and ``seconds`` when the input holds a clip (the
  values of the JSONL lines; Parquet int64 and list<double>; CSV the seconds as JSON text),
  and without a clip they are the files of the columns before clips, byte for byte: the
  column list and the CSV text are written here from the JSONL lines, not by the sinks.

Shown failing once with a fault injected: ``labels/read.py``'s manifest test back to
``"image" in d`` (eval and calibrate then read the manifest as a labels file, exit 2); and
``JobStore.holds_clips`` finding no clip (a job's CSV export then lacks the two columns).
The labels make every "red" answer wrong (derived from a first run), so the report shows
each answered item whatever the built-in model answers.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.labels.evaluation import evaluate, join
from vlmbatch.labels.read import read_labels, read_results

ROOT = Path(__file__).resolve().parents[2]
# the result columns before clips (Answer.COLUMNS when this was written), as the files had them
OLD_COLUMNS = ["id", "question_id", "question", "answer", "p_yes", "margin", "image_tokens",
               "error", "error_kind", "label", "probs", "logprobs", "text"]
SHAPES = ["circle", "square", "triangle"]


def questions(red: str, shape: str) -> list[dict]:
    return [{"id": "red", "text": "Is there a red shape?", "expected": red},
            {"id": "shape", "text": "Which shape is it?", "choices": SHAPES,
             "expected": shape}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("video-labels")
    (d / "clip.mkv").write_bytes(make_clip(frames(20, 64, 48), FFV1_MKV))  # 25 fps, 0.8 s
    (d / "text.mp4").write_text("not a clip")
    rng = np.random.default_rng(3)
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 256, (48, 72, 3), dtype=np.uint8)).save(d / name)
    lines = [{"id": "clip", "video": "clip.mkv", "num_frames": 4},
             {"id": "pair", "images": ["a.png", "b.png"]},
             {"id": "still", "image": "a.png"},
             {"id": "bad", "video": "text.mp4"}]
    (d / "m0.jsonl").write_text("".join(json.dumps({**x, "questions": questions("no", "circle")})
                                        + "\n" for x in lines))
    assert main(["run", str(d / "m0.jsonl"), "-o", str(d / "run0.jsonl"), "--dtype", "float32",
                 "--no-progress"]) == EXIT_ITEM_ERRORS
    # labels: every "red" answer wrong (so the report shows every answered item among its
    # wrong answers, whatever the model answers), shapes in turn
    red = {d["id"]: "no" if d["answer"] == "yes" else "yes" for d in lines_of(d / "run0.jsonl")
           if d["question_id"] == "red"}
    labelled = [{**x, "questions": questions(red[x["id"]], SHAPES[k % 3])}
                for k, x in enumerate(lines)]
    (d / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in labelled))
    (d / "plain.jsonl").write_text("".join(json.dumps(x) + "\n" for x in labelled[1:3]))
    assert main(["run", str(d / "m.jsonl"), "-o", str(d / "run.jsonl"), "--dtype", "float32",
                 "--no-progress"]) == EXIT_ITEM_ERRORS
    return d


def lines_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_eval_scores_clips_and_lists_as_run_does(folder: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["eval", str(folder / "m.jsonl"), "--json", "--dtype", "float32",
                 "--no-progress"]) == EXIT_ITEM_ERRORS  # the bad clip
    got = json.loads(capsys.readouterr().out)
    run = lines_of(folder / "run.jsonl")
    assert got == evaluate(join(read_results(folder / "run.jsonl"),
                                read_labels(folder / "m.jsonl"))).as_json()
    assert (got["labelled"], got["answered"], got["failed"]) == (8, 6, 2)
    labels = {(x["id"], q["id"]): q["expected"] for x in lines_of(folder / "m.jsonl")
              for q in x["questions"]}
    for qid in ("red", "shape"):  # counted here from run's lines
        answered = [d for d in run if d["question_id"] == qid and not d["error"]]
        assert got["questions"][qid]["answered"] == len(answered) == 3
        assert got["questions"][qid]["accuracy"] == pytest.approx(
            sum(d["answer"] == labels[(d["id"], qid)] for d in answered) / 3)
    assert got["questions"]["red"]["accuracy"] == 0.0  # the labels say so
    clip = next(d for d in run if d["id"] == "clip")
    assert clip["frames"] == 4 and clip["seconds"] == [0.08, 0.28, 0.48, 0.68]  # InternVL


def test_calibrate_takes_a_manifest_of_clips_as_labels(folder: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["calibrate", str(folder / "run.jsonl"), "--labels", str(folder / "m.jsonl"),
                 "--f1", "--json"]) == EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert list(got["questions"]) == ["red"] and got["missing"] == 0


@pytest.fixture(scope="module")
def job(folder: Path) -> Path:
    job = folder / "job"
    assert main(["submit", str(folder / "m.jsonl"), "--job", str(job), "--dtype", "float32",
                 "--wait", "--no-progress"]) == EXIT_ITEM_ERRORS
    return job


def test_report_shows_a_strip_per_clip_and_the_images_of_a_list(folder: Path, job: Path
                                                                ) -> None:
    out = folder / "report.html"
    assert main(["report", str(job), "-o", str(out), "--borderline", "8"]) == EXIT_OK
    page = out.read_text()
    figures = re.findall(r"<figure[^>]*>(.*?)</figure>", page, re.S)
    by_id = {}
    for f in figures:
        by_id.setdefault(re.search(r"<figcaption>([^<]*)<br>", f).group(1), f)
    clip, pair = by_id["clip"], by_id["pair"]
    assert '<div class="strip clip">' in clip
    assert re.findall(r'title="([^"]*)"', clip) == ["0.08 s", "0.28 s", "0.48 s", "0.68 s"]
    assert clip.count('src="data:image/jpeg;base64,') == 4
    assert '<div class="strip list">' in pair
    assert re.findall(r'title="([^"]*)"', pair) == ["image 1", "image 2"]
    assert pair.count('src="data:image/jpeg;base64,') == 2
    assert "strip" not in by_id["still"] and by_id["still"].count("<img ") == 1


def heavy_modules(*args: str) -> set[str]:
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "vlmbatch", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ))
    assert p.returncode == EXIT_OK, p.stderr[-2000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines()
               if line.startswith("import time:")}
    return {m for m in ("av", "cv2", "torch") if m in modules}


def test_report_and_calibrate_import_no_decoder_without_a_clip(folder: Path, job: Path
                                                               ) -> None:
    plain = folder / "plain-job"
    assert main(["submit", str(folder / "plain.jsonl"), "--job", str(plain), "--dtype",
                 "float32", "--wait", "--no-progress"]) == EXIT_OK
    assert heavy_modules("report", str(plain), "-o", str(folder / "p.html")) == set()
    assert heavy_modules("calibrate", str(folder / "run.jsonl"), "--labels",
                         str(folder / "m.jsonl"), "--f1") == set()
    # the check sees a decoder where one is needed: a clip's strip
    assert "av" in heavy_modules("report", str(job), "-o", str(folder / "c.html"))


def test_csv_and_parquet_carry_frames_and_seconds_with_clips(folder: Path, job: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    lines = lines_of(folder / "run.jsonl")
    out = folder / "run.csv"
    assert main(["run", str(folder / "m.jsonl"), "-o", str(out), "--dtype", "float32",
                 "--no-progress"]) == EXIT_ITEM_ERRORS
    rows = list(csv.DictReader(out.open(newline="")))
    assert list(rows[0]) == [*OLD_COLUMNS, "frames", "seconds"]
    for d, row in zip(lines, rows, strict=True):
        assert row["id"] == d["id"] and row["p_yes"] == ("" if d["p_yes"] is None
                                                           else str(d["p_yes"]))
        if "frames" in d:
            assert int(row["frames"]) == d["frames"]
            assert json.loads(row["seconds"]) == d["seconds"]
        else:
            assert row["frames"] == row["seconds"] == ""
    assert main(["results", str(job), "-o", str(folder / "job.csv")]) == EXIT_OK
    assert (folder / "job.csv").read_bytes() == out.read_bytes()  # a job's export: the same
    assert main(["results", str(job), "-o", str(folder / "r.parquet")]) == EXIT_OK
    table = pq.read_table(folder / "r.parquet")
    assert table.column_names == [*OLD_COLUMNS, "frames", "seconds"]
    assert str(table.schema.field("frames").type) == "int64"
    seconds = table.schema.field("seconds").type  # a list of float64 (Parquet names its item
    assert seconds.num_fields == 1 and str(seconds.value_type) == "double"  # "element")
    assert str(seconds).startswith("list<")
    got = table.to_pylist()
    assert [(r["id"], r["frames"], r["seconds"]) for r in got] == [
        (d["id"], d.get("frames"), d.get("seconds")) for d in lines]


def test_without_clips_csv_and_parquet_are_as_before(folder: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    plain, out = folder / "plain-job", folder / "plain.csv"
    if not plain.exists():
        assert main(["submit", str(folder / "plain.jsonl"), "--job", str(plain), "--dtype",
                     "float32", "--wait", "--no-progress"]) == EXIT_OK
    assert main(["run", str(folder / "plain.jsonl"), "-o", str(out), "--dtype", "float32",
                 "--no-progress"]) == EXIT_OK
    assert main(["run", str(folder / "plain.jsonl"), "-o", str(folder / "plain.jsonl.out"),
                 "--dtype", "float32", "--no-progress"]) == EXIT_OK
    # the CSV as it was before clips, written here from the JSONL lines and the old columns
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, OLD_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for d in lines_of(folder / "plain.jsonl.out"):
        w.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v
                    for k, v in d.items()})
    assert out.read_bytes() == buf.getvalue().encode()
    assert main(["results", str(plain), "-o", str(folder / "plain-job.csv")]) == EXIT_OK
    assert (folder / "plain-job.csv").read_bytes() == out.read_bytes()
    assert main(["results", str(plain), "-o", str(folder / "plain.parquet")]) == EXIT_OK
    schema = pq.read_schema(folder / "plain.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        (n, {"p_yes": "double", "margin": "double", "image_tokens": "int64"}.get(n, "string"))
        for n in OLD_COLUMNS]
