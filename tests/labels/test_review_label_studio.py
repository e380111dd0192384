"""The review loop against a real Label Studio 1.23 (``tests/label_studio.py``: its own venv,
started here on loopback): the project created from our configuration and the tasks imported
by ``review export --url``, annotations made through its API as labellers would (most agree
with the model, some flip a borderline answer, one is cancelled, one annotator changes their
mind, two annotators disagree on one image), exported as JSON and JSON_MIN, read back by
``review import`` (files and ``--url``), and ``calibrate`` and ``report`` run on the result.

Slow (Label Studio's first start migrates a fresh database: ~2 min on a loaded machine, and
the venv takes ~13 min to install the first time): ``pytest --run-slow
tests/labels/test_review_label_studio.py``, before each stop (docs/labels.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.label_studio import LabelStudio, label_studio
from tests.labels.report_job import ROOT, make_job
from vlmbatch.cli.main import EXIT_OK, main
from vlmbatch.labels.read import read_labels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
QUESTIONS = ("red", "odd", "category", "far")


@pytest.fixture(scope="module")
def studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabelStudio]:
    with label_studio(tmp_path_factory.mktemp("ls"), ROOT / "examples") as ls:
        yield ls


def _choice(qid: str, value: str) -> dict:
    return {"from_name": qid, "to_name": "image", "type": "choices",
            "value": {"choices": [value]}}


def _annotate(ls: LabelStudio, task: dict, answers: dict[str, str], who: int | None = None,
              cancelled: bool = False) -> None:
    body: dict = {"result": [] if cancelled else [_choice(q, v) for q, v in answers.items()],
                  "was_cancelled": cancelled}
    if who is not None:  # the admin records another annotator's work
        body["completed_by"] = who
    ls.call("POST", f"/api/tasks/{task['id']}/annotations/", body)


def _label(listed: list[dict], tasks: list[dict], studio: LabelStudio
           ) -> dict[tuple[str, str], str]:
    """Annotate the first 12 tasks (the most borderline: Label Studio's ``listed``, ours in
    ``tasks``, one order) as two labellers would; returns what the labels file must hold: the
    latest answer per (image, question)."""
    other = studio.call("POST", "/api/users/", {"email": "second@example.com",
                                                "username": "second"})["id"]
    want: dict[tuple[str, str], str] = {}
    for k, (t, ours) in enumerate(zip(listed[:12], tasks)):
        image = t["data"]["image_id"]
        model = {r["from_name"]: r["value"]["choices"][0]
                 for r in ours["predictions"][0]["result"]}
        if k == 5:  # skipped: says nothing
            _annotate(studio, t, {}, cancelled=True)
            continue
        answers = dict(model)
        if k % 3 == 1:  # the borderline answer flipped
            answers["red"] = "no" if model["red"] == "yes" else "yes"
        _annotate(studio, t, answers)
        if k == 0:  # a second annotator, later, disagreeing on "red"
            answers = {**answers, "red": "no" if answers["red"] == "yes" else "yes"}
            _annotate(studio, t, answers, who=other)
        if k == 2:  # the first annotator changes their mind on "far"
            answers = {**answers, "far": "no" if answers["far"] == "yes" else "yes"}
            _annotate(studio, t, answers)
        want.update({(image, q): v for q, v in answers.items()})
    return want


def _labels(path: Path) -> dict[tuple[str, str], str]:
    return {k: v.expected for k, v in read_labels(path).items()}


def test_the_review_loop(studio: LabelStudio, tmp_path: Path,
                         capsys: pytest.CaptureFixture) -> None:
    job, _ = make_job(tmp_path)
    tasks_file, config = tmp_path / "tasks.json", tmp_path / "config.xml"
    at = ["--url", studio.url, "--token", studio.token, "--project", "moderation"]
    assert main(["review", "export", str(job), "--document-root", str(ROOT / "examples"),
                 "-o", str(tasks_file), "--config-out", str(config), *at]) == EXIT_OK
    tasks = json.loads(tasks_file.read_text())
    (project,) = [p for p in studio.call("GET", "/api/projects")["results"]
                  if p["title"] == "moderation"]
    assert project["label_config"].strip() == config.read_text().strip()
    # Label Studio's own order by prediction score (lowest first) is ours: most borderline first
    view = studio.call("POST", "/api/dm/views", {"project": project["id"], "data": {
        "ordering": ["tasks:predictions_score"]}})
    listed = studio.call("GET", f"/api/tasks?view={view['id']}&page_size=100")["tasks"]
    assert [t["data"]["image_id"] for t in listed] == [t["data"]["image_id"] for t in tasks]
    served = studio.call("GET", listed[0]["data"]["image"])  # the local-files storage serves it
    assert served == (ROOT / "examples" / listed[0]["data"]["image"].split("?d=")[1]).read_bytes()

    want = _label(listed, tasks, studio)
    for kind in ("JSON", "JSON_MIN"):
        data = studio.call("GET", f"/api/projects/{project['id']}/export?exportType={kind}")
        (tmp_path / f"{kind}.json").write_bytes(data if isinstance(data, bytes)
                                                else json.dumps(data).encode())
        capsys.readouterr()
        out = tmp_path / f"labels-{kind}.jsonl"
        assert main(["review", "import", str(tmp_path / f"{kind}.json"), "-o", str(out)]) == 0
        assert _labels(out) == want, kind
        err = capsys.readouterr().err
        first = listed[0]["data"]["image_id"]
        assert f"1 disagreements between annotators (the latest annotation kept): {first}/red" \
            in err, err
        # JSON keeps the cancelled annotation (skipped here); JSON_MIN leaves it out itself
        assert f"{1 if kind == 'JSON' else 0} cancelled annotations skipped" in err, err
    pulled = tmp_path / "labels-pulled.jsonl"
    assert main(["review", "import", "-o", str(pulled), *at]) == EXIT_OK
    assert _labels(pulled) == want

    assert main(["calibrate", str(job), "--labels", str(pulled), "--f1", "--json"]) == EXIT_OK
    got = json.loads(capsys.readouterr().out)["questions"]
    for q in ("red", "odd", "far"):  # yes/no questions with labels of both kinds get one
        labelled = [v for (_, qid), v in want.items() if qid == q]
        if "yes" in labelled:
            assert (got[q]["positives"], got[q]["labelled"]) == (labelled.count("yes"),
                                                                 len(labelled)), q
    assert main(["report", str(job), "-o", str(tmp_path / "r.html"), "--labels",
                 str(pulled)]) == EXIT_OK
    assert f"{len(want)} answers reviewed." in (tmp_path / "r.html").read_text()
