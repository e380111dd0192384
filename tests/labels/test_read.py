"""Labels and result lines read back (``labels/read.py``), and ``expected`` on manifest and
policy questions (``inputs/manifest.py``): what is accepted, and each refusal naming its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmbatch.inputs.manifest import read_manifest, read_policy
from vlmbatch.jobs.store import image_item_from_json, image_item_to_json
from vlmbatch.labels.read import labelled_manifest, read_labels, read_results
from vlmbatch.pipeline.questions import ManifestError, check_expected


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return path


def q(qid: str, expected: object = None, **kw: object) -> dict:
    d = {"id": qid, "text": f"Is it {qid}?", **kw}
    if expected is not None:
        d["expected"] = expected
    return d


def test_expected_is_read_and_a_job_keeps_it(tmp_path: Path) -> None:
    """Decided again (issue 38): a job's store keeps labels (version 3), for the report's
    right/wrong marks; before, it dropped them."""
    m = write(tmp_path / "m.jsonl", [{"id": "a", "image": "a.png",
                                      "questions": [q("red", "yes"), q("big")]}])
    (item,) = read_manifest(m)
    assert [x.expected for x in item.questions] == ["yes", None]
    stored = image_item_from_json(image_item_to_json(item))
    assert stored == item and [x.expected for x in stored.questions] == ["yes", None]


@pytest.mark.parametrize("bad", ["Yes", "maybe", 1, ["yes"], ""])
def test_a_bad_expected_names_the_line(tmp_path: Path, bad: object) -> None:
    m = write(tmp_path / "m.jsonl", [{"id": "a", "image": "a.png", "questions": [q("ok")]},
                                     {"id": "b", "image": "b.png",
                                      "questions": [q("x"), {"text": "Y?", "expected": bad}]}])
    with pytest.raises(ManifestError, match=r"m.jsonl:2: question 1 expected must be one of "
                       r"a yes/no question's answers \['yes', 'no'\], got"):
        read_manifest(m)


def test_a_policy_s_expected_and_a_label_set_s_choices(tmp_path: Path) -> None:
    pol = tmp_path / "p.yaml"
    pol.write_text("questions:\n  - {id: red, text: 'Is it red?', expected: no}\n"
                   "  - {id: big, text: 'Is it big?', expected: \"yes\"}\n")
    assert [x.expected for x in read_policy(pol)] == ["no", "yes"]  # YAML's no: False
    pol.write_text("questions:\n  - {id: red, text: 'Is it red?', expected: nope}\n")
    with pytest.raises(ManifestError, match="p.yaml: question 0 expected must be one of"):
        read_policy(pol)
    # a label-set question's labels are its choices (what parse_question passes for one)
    assert check_expected("hate", ("safe", "hate"), "m:1", "question 0") == "hate"
    with pytest.raises(ManifestError, match=r"m:1: question 0 expected must be one of its "
                       r"answers \['safe', 'hate'\], got 'yes'"):
        check_expected("yes", ("safe", "hate"), "m:1", "question 0")


def test_labelled_manifest_asks_only_labelled_questions(tmp_path: Path) -> None:
    m = write(tmp_path / "m.jsonl", [
        {"id": "a", "image": "a.png", "questions": [q("red", "yes"), q("big")]},
        {"id": "b", "image": "b.png", "questions": [q("big")]},
        {"id": "c", "image": "c.png", "questions": [q("red", "no")]}])
    pol = tmp_path / "p.yaml"
    pol.write_text("questions:\n  - {id: shape, text: 'Is there a shape?', expected: yes}\n"
                   "  - {id: other, text: 'Unlabelled?'}\n")
    items, labels = labelled_manifest(m)
    assert [(it.id, [x.id for x in it.questions]) for it in items] == [("a", ["red"]),
                                                                       ("c", ["red"])]
    assert {k: (v.expected, v.where) for k, v in labels.items()} == {
        ("a", "red"): ("yes", f"{m}:1"), ("c", "red"): ("no", f"{m}:3")}
    items, labels = labelled_manifest(m, pol)
    assert [it.id for it in items] == ["a", "b", "c"]
    assert labels[("b", "shape")].where == str(pol) and len(labels) == 5
    assert read_labels(m, pol) == labels
    write(m, [{"id": "a", "image": "a.png", "questions": [q("big")]}])
    with pytest.raises(ManifestError, match="no question carries 'expected'"):
        labelled_manifest(m)


def test_a_labels_file(tmp_path: Path) -> None:
    f = write(tmp_path / "l.jsonl", [
        {"id": "a", "question_id": "red", "expected": "yes", "annotator": "kim"},
        "", {"id": 7, "question_id": "category", "expected": "hate"}])
    labels = read_labels(f)
    assert {k: (v.expected, v.where) for k, v in labels.items()} == {
        ("a", "red"): ("yes", f"{f}:1"), ("7", "category"): ("hate", f"{f}:3")}
    for bad, msg in [({"id": "a", "question_id": "red"}, r'l.jsonl:2: a labels line is '
                      r'\{"id", "question_id", "expected"\}'),
                     ({"id": "a", "question_id": "red", "expected": 1}, "l.jsonl:2: expected "
                      "must be a non-empty string"),
                     ({"id": None, "question_id": "red", "expected": "no"}, "l.jsonl:2: id "
                      "must be"),
                     ({"id": "a", "question_id": "red", "expected": "no"}, "l.jsonl:2: image "
                      "'a' question 'red' is labelled twice \\(first on .*l.jsonl:1\\)")]:
        write(f, [{"id": "a", "question_id": "red", "expected": "yes"}, bad])
        with pytest.raises(ManifestError, match=msg):
            read_labels(f)
    write(f, ["{not json"])
    with pytest.raises(ManifestError, match="l.jsonl:1: not valid JSON"):
        read_labels(f)
    with pytest.raises(ManifestError, match="labels .*nowhere.jsonl not found"):
        read_labels(tmp_path / "nowhere.jsonl")


def test_results_from_a_file(tmp_path: Path) -> None:
    line = {"id": "a", "question_id": "red", "question": "Is it red?", "answer": "no",
            "p_yes": 0.25, "margin": -1.1, "image_tokens": 80, "error": None}
    f = write(tmp_path / "r.jsonl", [line, {**line, "id": "b", "answer": None, "p_yes": None,
                                            "error": "gone", "error_kind": "source"}])
    a, b = read_results(f)
    assert (a.image_id, a.answer, a.p_yes, a.error, a.where) == ("a", "no", 0.25, None,
                                                                 f"{f}:1")
    assert (b.answer, b.error, b.error_kind) == (None, "gone", "source")
    write(f, [line, {**line, "answer": "perhaps"}])
    with pytest.raises(ManifestError, match="r.jsonl:2: an answered line needs p_yes and "
                       "answer yes/no"):
        list(read_results(f))
