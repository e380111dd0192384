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

from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.evaluate import evaluate_labelled, policy_note
from vlmbatch.cli.main import main
from vlmbatch.inputs.manifest import read_policy
from vlmbatch.jobs.config import RunConfig
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
    """The job of a labelled manifest: its store keeps the labels (before, it dropped them),
    so the page marks each answer shown right or wrong and counts them per question, the
    counts `eval` gets from the same labels; a question none of whose answers is near its
    threshold says so instead of showing a "borderline" sheet."""
    manifest, results, job = labelled
    out = tmp_path / "r.html"
    capsys.readouterr()
    assert main(["report", str(job), "-o", str(out), "--borderline", "3"]) == EXIT_OK
    assert capsys.readouterr().err == f"vlmbatch: wrote {out} (4 questions, 0 failed images)\n"
    page = out.read_text()
    got = evaluate(join(read_results(results), read_labels(manifest))).as_json()["questions"]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    shown = 0
    for qid, m in got.items():
        section = page[page.index(f"<h2>{qid}: "):]
        section = section[:section.index("<h2>", 4)] if "<h2>" in section[4:] else section
        wrong = m["answered"] - round(m["accuracy"] * m["answered"])
        assert f"12 labelled: {12 - wrong} right, {wrong} wrong" in section, section[:400]
        near = sum(abs(np.log(max(r["p_yes"], 1e-6) / max(1 - r["p_yes"], 1e-6))) <= 1
                   for r in rows if r["question_id"] == qid)  # threshold 0.5: log-odds 0
        assert ("Nothing is near the threshold" in section) == (near == 0)
        assert ("Borderline:" in section) == (near > 0)
        marks = section.count("<b>right</b>") + section.count("<b>wrong</b>")
        assert marks == section.count("<img ") == min(near, 3) + min(wrong, 3)
        shown += marks
    assert shown == page.count("<img ") and shown > 0
    assert "Nothing is near the threshold" in page  # the built-in model is sure of most
    assert main(["report", str(job), "-o", str(tmp_path / "r.txt")]) == EXIT_BAD_INPUT
    assert "give an .html file" in capsys.readouterr().err
    for args in (["status"], ["report", "-o", str(out)]):  # no job: said so, by both
        assert main([*args, str(tmp_path)]) == EXIT_BAD_INPUT
        assert f"{tmp_path} is not a vlmbatch job folder" in capsys.readouterr().err


def _half(tmp: Path, name: str, lines: list[str]) -> Path:
    m = tmp / name
    m.write_text("".join(json.dumps({**d, "image": str(EXAMPLE / d["image"])}) + "\n"
                         for d in map(json.loads, lines)))
    return m


def test_calibrate_on_one_half_check_on_the_other(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """The README's loop, end to end through the CLI: calibrate on half of the labelled
    example, write the policy, `eval` the other half with it. Before, eval refused ("question
    id(s) ... are used by both this line and the policy"). The metrics are those of the
    other half's `run` lines with the policy's thresholds applied by hand."""
    lines = (EXAMPLE / "manifest.jsonl").read_text().splitlines()
    fit, check = _half(tmp_path, "fit.jsonl", lines[:24]), _half(tmp_path, "check.jsonl",
                                                                  lines[24:])
    fit_r, check_r, policy = tmp_path / "fit_r.jsonl", tmp_path / "check_r.jsonl", \
        tmp_path / "calibrated.yaml"
    for m, r in ((fit, fit_r), (check, check_r)):
        assert main(["run", str(m), "-o", str(r), "--no-progress"]) == EXIT_OK
    assert main(["calibrate", str(fit_r), "--labels", str(fit), "--precision", "0.95",
                 "--write-policy", str(policy)]) == EXIT_OK
    thresholds = {q.id: q.threshold for q in read_policy(policy)}
    assert sorted(thresholds) == ["circle", "red", "three", "triangle"]
    assert any(t != 0.5 for t in thresholds.values())
    capsys.readouterr()
    assert main(["eval", str(check), "--policy", str(policy), "--json", "--no-progress"]) \
        == EXIT_OK, capsys.readouterr().err
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert f"at the thresholds of {policy}: red {thresholds['red']}, circle" in out.err
    rows = [json.loads(x) for x in check_r.read_text().splitlines()]
    labels = {(d["id"], q["id"]): q["expected"] for d in map(json.loads, lines[24:])
              for q in d["questions"]}
    assert got["answered"] == len(rows) == 96
    for qid, t in thresholds.items():
        yes = np.array([r["p_yes"] >= t for r in rows if r["question_id"] == qid])
        want = np.array([labels[(r["id"], qid)] == "yes" for r in rows
                         if r["question_id"] == qid])
        q = got["questions"][qid]
        assert q["accuracy"] == pytest.approx((yes == want).mean())
        assert q["recall"] == pytest.approx((yes & want).sum() / want.sum())
        assert q["precision"] == pytest.approx((yes & want).sum() / max(yes.sum(), 1))
    # what the same set scores at 0.5 differs: the policy's thresholds were used
    assert main(["eval", str(check), "--json", "--no-progress"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) != got


def test_eval_with_a_policy_through_the_api_and_its_refusals(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``evaluate_labelled`` (the Python side of `eval`) with a policy: its threshold, the
    line's label; a text, label set or label that contradicts the line's is refused naming
    both; a policy question no line labels is named as not evaluated."""
    lines = (EXAMPLE / "manifest.jsonl").read_text().splitlines()[:4]
    m = _half(tmp_path, "m.jsonl", lines)
    policy = tmp_path / "p.yaml"
    policy.write_text('questions:\n  - {id: red, text: "Is there a red shape?", threshold: 1.0}\n'
                      '  - {id: blue, text: "Is there a blue shape?"}\n')
    summary, report = evaluate_labelled(RunConfig(manifest=m, policy=policy, progress=False))
    red = next(q for q in report.questions if q.question_id == "red")
    assert (red.answered, red.precision, red.recall) == (4, None, 0.0)  # nothing >= 1.0
    assert [q.question_id for q in report.questions] == ["red", "circle", "triangle", "three"]
    assert policy_note(policy, report) == (f"at the thresholds of {policy}: red 1.0; not "
                                           "evaluated (no label in this manifest): blue")
    for text, says in [
            ('{id: red, text: "Is it red?"}', "question 'red' is 'Is there a red shape?' on "
             "this line but 'Is it red?' in the policy"),
            ('{id: red, text: "Is there a red shape?", choices: [a, b]}', "question 'red' is "
             "a yes/no question on this line but a label set ['a', 'b'] in the policy"),
            ('{id: red, text: "Is there a red shape?", expected: true}',
             "question 'red' has expected 'no' on this line and 'yes' in the policy")]:
        policy.write_text(f"questions:\n  - {text}\n")
        capsys.readouterr()
        assert main(["eval", str(m), "--policy", str(policy), "--no-progress"]) == \
            EXIT_BAD_INPUT
        assert f"{m}:1: {says}" in capsys.readouterr().err


def test_calibrate_carries_label_sets_over_and_refuses_labels_of_other_results(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--write-policy`` keeps each label-set question as it was asked (id, text, choices),
    uncalibrated and said so in a comment, beside the calibrated yes/no ones; labels none of
    which names a result line are exit 2 saying so, not an empty table."""
    results = tmp_path / "r.jsonl"
    assert main(["run", str(ROOT / "examples" / "labels.jsonl"), "--policy",
                 str(ROOT / "examples" / "labels.yaml"), "-o", str(results),
                 "--no-progress"]) == EXIT_OK
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({"id": d["id"], "question_id": d["question_id"],
                                          "expected": d["answer"]}) + "\n" for d in rows))
    sets = {d["question_id"]: (d["question"], list(d["probs"])) for d in rows if d.get("probs")}
    yes_no = {d["question_id"] for d in rows if not d.get("probs") and d["answer"] == "yes"}
    assert sets and yes_no  # the example asks both kinds
    policy = tmp_path / "cal.yaml"
    capsys.readouterr()
    assert main(["calibrate", str(results), "--labels", str(labels), "--f1",
                 "--write-policy", str(policy)]) == EXIT_OK
    err = capsys.readouterr().err
    assert "of them label sets carried over uncalibrated" in err and f"{len(sets)}" in err
    got = {q.id: q for q in read_policy(policy)}
    assert set(got) == yes_no | set(sets)
    for qid, (text, choices) in sets.items():
        assert (got[qid].text, list(got[qid].choices)) == (text, choices)
        assert f"# {qid}: a label set, carried over as asked and not calibrated" in \
            policy.read_text()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "nobody", "question_id": "red", "expected": "yes"}) + "\n")
    for extra in ([], ["--write-policy", str(tmp_path / "none.yaml")]):
        assert main(["calibrate", str(results), "--labels", str(other), "--f1",
                     *extra]) == EXIT_BAD_INPUT
        assert "none of its 1 label(s) matches a result line" in capsys.readouterr().err
    assert not (tmp_path / "none.yaml").exists()
