"""``vlmbatch eval MANIFEST``, ``calibrate`` and ``report`` end to end, on part of the
labelled example (``examples/labelled``) and the built-in model: eval's metrics are those
of ``vlmbatch run``'s lines of the same manifest; calibrate gives the same on a results
file as on a job folder, and the policy it writes reads back with its thresholds; bad input
is exit 2 naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmbatch.app.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vlmbatch.jobs.manifest import read_policy
from vlmbatch.labels.evaluation import evaluate, join
from vlmbatch.labels.read import read_labels, read_results

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "labelled"


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a 12-image labelled manifest, its results from `vlmbatch run`, a job of it)."""
    tmp = tmp_path_factory.mktemp("labelled")
    lines = (EXAMPLE / "manifest.jsonl").read_text().splitlines()[:12]
    manifest = tmp / "m.jsonl"
    manifest.write_text("".join(
        json.dumps({**d, "image": str(EXAMPLE / d["image"])}) + "\n"
        for d in map(json.loads, lines)))
    results = tmp / "r.jsonl"
    assert main(["run", str(manifest), "-o", str(results), "--no-progress"]) == EXIT_OK
    job = tmp / "job"
    assert main(["submit", str(manifest), "--job", str(job), "--wait", "--no-progress"]) == 0
    return manifest, results, job


def test_eval_manifest_scores_run_s_lines(labelled: tuple[Path, Path, Path],
                                         capsys: pytest.CaptureFixture) -> None:
    manifest, results, _ = labelled
    capsys.readouterr()
    assert main(["eval", str(manifest), "--json", "--no-progress"]) == EXIT_OK
    got = json.loads(capsys.readouterr().out)
    want = evaluate(join(read_results(results), read_labels(manifest))).as_json()
    assert got == want
    assert (got["labelled"], got["answered"], got["failed"]) == (48, 48, 0)
    assert list(got["questions"]) == ["red", "circle", "triangle", "three"]
    assert main(["eval", str(manifest), "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("labelled evaluation: 48 answered of 48 labelled lines")
    assert out[1].split() == ["question", "kind", "n", "accuracy", "precision", "recall",
                              "f1", "auroc", "ece"]
    assert [row.split()[0] for row in out[2:]] == ["red", "circle", "triangle", "three"]


def test_eval_refusals(labelled: tuple[Path, Path, Path], tmp_path: Path,
                       capsys: pytest.CaptureFixture) -> None:
    manifest, _, _ = labelled
    capsys.readouterr()
    assert main(["eval", "--json"]) == EXIT_BAD_INPUT
    assert "--policy and --json apply to `vlmbatch eval MANIFEST`" in capsys.readouterr().err
    assert main(["eval", str(manifest), "--limit", "3"]) == EXIT_BAD_INPUT
    assert "a manifest's are all asked" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    first = json.loads(manifest.read_text().splitlines()[0])
    first["questions"][1]["expected"] = "circle"
    bad.write_text(manifest.read_text().splitlines()[1] + "\n" + json.dumps(first) + "\n")
    assert main(["eval", str(bad), "--no-progress"]) == EXIT_BAD_INPUT
    assert f"{bad}:2: question 1 expected must be one of" in capsys.readouterr().err
    bad.write_text(json.dumps({"id": "a", "image": first["image"], "questions": ["Red?"]}))
    assert main(["eval", str(bad), "--no-progress"]) == EXIT_BAD_INPUT
    assert "no question carries 'expected'" in capsys.readouterr().err


def test_calibrate_on_results_and_on_a_job(labelled: tuple[Path, Path, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    manifest, results, job = labelled
    labels = tmp_path / "labels.jsonl"  # the same labels as a labels file
    labels.write_text("".join(json.dumps({"id": d["id"], "question_id": q["id"],
                                          "expected": q["expected"]}) + "\n"
                              for d in map(json.loads, manifest.read_text().splitlines())
                              for q in d["questions"]))
    capsys.readouterr()
    outs = []
    for res, lab in ((results, labels), (job, manifest)):
        assert main(["calibrate", str(res), "--labels", str(lab), "--recall", "0.9",
                     "--json"]) == EXIT_OK
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
    policy, plots = tmp_path / "p.yaml", tmp_path / "plots"
    assert main(["calibrate", str(job), "--labels", str(labels), "--recall", "0.9",
                 "--write-policy", str(policy), "--plots", str(plots)]) == EXIT_OK
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "target: recall >= 0.9 (yes when p_yes >= threshold)"
    qs = outs[0]["questions"]
    assert {q.id: q.threshold for q in read_policy(policy)} == {
        k: v["threshold"] for k, v in qs.items() if v["threshold"] is not None}
    for name in ("pr.png", "roc.png"):
        with Image.open(plots / name) as im:
            px = np.asarray(im.convert("L"))
        assert im.size == (600, 500) and (px < 128).mean() > 0.01  # axes, text, curves
    with pytest.raises(SystemExit) as e:  # two targets: argparse's usage error
        main(["calibrate", str(results), "--labels", str(labels), "--f1", "--recall", "0.5"])
    assert e.value.code == 2
    assert main(["calibrate", str(results), "--labels", str(results), "--f1"]) == \
        EXIT_BAD_INPUT
    assert 'a labels line is {"id", "question_id", "expected"}' in capsys.readouterr().err


def test_report_command(labelled: tuple[Path, Path, Path], tmp_path: Path,
                        capsys: pytest.CaptureFixture) -> None:
    _, _, job = labelled
    out = tmp_path / "r.html"
    capsys.readouterr()
    assert main(["report", str(job), "-o", str(out), "--borderline", "3"]) == EXIT_OK
    assert capsys.readouterr().err == f"vlmbatch: wrote {out} (4 questions, 0 failed images)\n"
    page = out.read_text()
    assert page.count("<img ") == 4 * 3 and page.count("<svg ") == 4
    assert main(["report", str(job), "-o", str(tmp_path / "r.txt")]) == EXIT_BAD_INPUT
    assert "give an .html file" in capsys.readouterr().err
