"""``--reuse OLD_JOB`` (``jobs/reuse.py``), one test per rule, on the built-in model: a job
answers a 4-question policy about 6 images; a second policy changes one threshold, rewords
one question and adds one. What is reused must equal the earlier job's lines, what is
computed a full run's, and nothing crosses a model or a preprocessing change."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from vlmbatch.engine.config import ModelConfig
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import STORE_FILE, status
from vlmbatch.jobs.job import run_job, submit
from vlmbatch.jobs.reuse import Pass, Reuse
from vlmbatch.jobs.store import JobStore
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.pipeline.records import ImageItem

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "examples" / "labelled" / "images").glob("*.png"))[:6]
OLD = [{"id": "red", "text": "Is there a red shape?"},
       {"id": "circle", "text": "Does the image contain a circle?"},
       {"id": "triangle", "text": "Is there a triangle?"},
       {"id": "three", "text": "Are there three shapes?"}]
NEW = [OLD[0], {"id": "circle", "text": "Does the image contain a circle?",
                "threshold": 0.01},  # threshold changed
       OLD[2],
       {"id": "three", "text": "Are there exactly three shapes?"},  # reworded
       {"id": "green", "text": "Is there a green shape?"}]  # new
TOL = 2e-3  # P(yes) of a question asked alone vs beside others: batching, not the answer


def _job(tmp: Path, name: str, policy: list[dict], reuse: Path | None = None,
         model: Path | None = None) -> Path:
    images = tmp / "images"
    if not images.exists():
        images.mkdir()
        for p in IMAGES:
            shutil.copy(p, images / p.name)
    (tmp / f"{name}.jsonl").write_text("".join(
        json.dumps({"id": p.stem, "image": f"images/{p.name}"}) + "\n" for p in IMAGES))
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump({"questions": policy}))
    cfg = RunConfig(manifest=tmp / f"{name}.jsonl", policy=tmp / f"{name}.yaml", threads=2,
                    model=ModelConfig(path=model), progress=False)
    submit(cfg, tmp / name, reuse=reuse)
    run_job(tmp / name, progress=False)
    return tmp / name


def _lines(job: Path) -> dict[tuple[str, str], dict]:
    store = JobStore(job / STORE_FILE)
    try:
        return {(d["id"], d["question_id"]): d for d in store.records()}
    finally:
        store.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("reuse")
    old = _job(tmp, "old", OLD)
    return {"old": old, "full": _job(tmp, "full", NEW), "reused": _job(tmp, "reused", NEW, old),
            "tmp": tmp}


def test_unchanged_answers_are_copied(jobs: dict[str, Path]) -> None:
    old, got = _lines(jobs["old"]), _lines(jobs["reused"])
    for (image, q), d in got.items():
        if q in ("red", "triangle"):
            assert d == old[image, q]  # the very line, not recomputed
    st = status(jobs["reused"])
    assert (st.reused, st.questions) == (6 * 3, 6 * 5)  # red, circle, triangle of 6 images
    assert "18 reused, 12 computed" in st.text()


def test_a_changed_threshold_is_redecided_from_the_stored_p_yes(jobs: dict[str, Path]) -> None:
    old, got, full = _lines(jobs["old"]), _lines(jobs["reused"]), _lines(jobs["full"])
    flipped = 0
    for image in (p.stem for p in IMAGES):
        d = got[image, "circle"]
        assert d["p_yes"] == old[image, "circle"]["p_yes"]
        assert d["answer"] == ("yes" if d["p_yes"] >= 0.01 else "no") == full[image, "circle"][
            "answer"]
        flipped += d["answer"] != old[image, "circle"]["answer"]
    assert flipped  # the change mattered for some image


def test_new_and_reworded_questions_are_computed(jobs: dict[str, Path]) -> None:
    got, full = _lines(jobs["reused"]), _lines(jobs["full"])
    assert got.keys() == full.keys()
    for key, d in got.items():
        assert d["answer"] == full[key]["answer"], key
        assert d["p_yes"] == pytest.approx(full[key]["p_yes"], abs=TOL), key
    assert [k[1] for k in got if k[0] == IMAGES[0].stem] == [q["id"] for q in NEW]  # in order


def test_an_item_goes_to_the_engine_once_with_only_its_new_questions() -> None:
    p = Pass(partial={"a": {"red": {"question_id": "red"}}}, order={"a": ("red", "green")})
    item = ImageItem("a", "x.png", [{"id": "red", "text": "R?"}, {"id": "green", "text": "G?"}])
    assert [q.id for q in p.strip(item).questions] == ["green"]


def test_a_different_model_fingerprint_reuses_nothing(jobs: dict[str, Path]) -> None:
    tmp = jobs["tmp"]
    model = tmp / "same-weights"
    shutil.copytree(DEFAULT_MODEL, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "note": "a copy"}))  # other files
    r = Reuse.open(jobs["old"], RunConfig(manifest=tmp / "old.jsonl", policy=tmp / "old.yaml",
                                          model=ModelConfig(path=model)))
    assert r.why_not == "model differ" and not r.answers
    again = _job(tmp, "other-model", OLD, jobs["old"], model=model)
    assert status(again).reused == 0
    assert _lines(again).keys() == _lines(jobs["old"]).keys()


def test_a_preprocessing_change_reuses_nothing(jobs: dict[str, Path]) -> None:
    tmp = jobs["tmp"]
    for model in (ModelConfig(max_tiles=1), ModelConfig(tiling="reference"),
                  ModelConfig(dtype="bfloat16")):
        r = Reuse.open(jobs["old"], RunConfig(manifest=tmp / "old.jsonl", model=model))
        assert r.why_not is not None and not r.answers, model


def test_reuse_follows_content_not_path(jobs: dict[str, Path], tmp_path: Path) -> None:
    tmp = jobs["tmp"]
    cfg = RunConfig(manifest=tmp / "old.jsonl", policy=tmp / "old.yaml")
    r = Reuse.open(jobs["old"], cfg)
    copy = tmp_path / "renamed.png"
    shutil.copy(IMAGES[0], copy)
    q = [{"id": "r", "text": "Is there a red shape?", "threshold": 0.5}]
    found = r.of(ImageItem("x", str(copy), q))
    assert found["r"]["p_yes"] == _lines(jobs["old"])[IMAGES[0].stem, "red"]["p_yes"]
    assert r.of(ImageItem("y", str(IMAGES[1]), [{"id": "r", "text": "Is it red?"}])) == {}
    # an earlier job's image changed after that job was submitted: its answers are not trusted
    changed = tmp / "images" / IMAGES[2].name
    before, times = changed.read_bytes(), changed.stat()
    changed.write_bytes(IMAGES[3].read_bytes())
    try:
        r2 = Reuse.open(jobs["old"], cfg)
    finally:  # as it was, for the other tests of the module
        changed.write_bytes(before)
        os.utime(changed, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert r2.of(ImageItem("z", str(IMAGES[3]), q))["r"]["p_yes"] == \
        _lines(jobs["old"])[IMAGES[3].stem, "red"]["p_yes"]
    assert sum(len(v) for v in r2.answers.values()) == 5 * 4  # image 2's four answers dropped


def test_the_command_line_says_what_was_reused(jobs: dict[str, Path],
                                               capsys: pytest.CaptureFixture) -> None:
    """`run MANIFEST --reuse OLD_JOB` (a job kept in a temporary folder) prints the same lines
    as the job submitted with --reuse, and says how many answers it copied."""
    from vlmbatch.cli.main import main
    tmp = jobs["tmp"]
    out = tmp / "cli.jsonl"
    capsys.readouterr()
    assert main(["run", str(tmp / "full.jsonl"), "--policy", str(tmp / "full.yaml"),
                 "--reuse", str(jobs["old"]), "-o", str(out), "--threads", "2",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "18 answers reused from" in err and "(18 reused, 12 computed)" in err, err
    got = {(d["id"], d["question_id"]): d for d in map(json.loads, out.read_text().splitlines())}
    want = _lines(jobs["reused"])
    assert got.keys() == want.keys()
    for k in got:  # a results line is the stored line less its token counts
        assert got[k] == {f: want[k][f] for f in got[k]}, (k, got[k], want[k])
