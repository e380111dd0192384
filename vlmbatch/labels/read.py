"""Labelled data for ``eval``, ``calibrate`` and ``report``: result lines read back as typed
records (``Scored``) and the user's labels (``Label``), each knowing the line it came from.

Result lines come from a results file (``vlmbatch run -o r.jsonl``, ``vlmbatch results JOB``)
or a job folder (its store). A yes/no line is ``{"id", "question_id", "question", "answer",
"p_yes", "margin", "image_tokens", "error", "error_kind"?}``; a label-set line has
``"label"`` (the most probable choice), ``"probs"`` (choice -> probability, in the choices'
order), ``"logprobs"`` and ``"p_yes": null``.

Labels (``--labels``) come in either of two files, told apart by their first line:

- a labels file: one JSON line per (image id, question id), ``{"id": "a1",
  "question_id": "red", "expected": "yes"}`` (other keys are ignored: an annotator's name,
  a note);
- a manifest whose questions carry ``"expected"`` (``inputs/manifest.py``), a policy's
  questions too when one is given: a policy's label holds for every image, and a policy
  question with the id of a line's is that question, at the policy's threshold.

A part's line (``"part"``: one window of a clip or one image of a per-image list) is
skipped: its item's line for the question carries the answer.

A label is validated against its result line when the two are joined (``evaluation.py``):
``"yes"``/``"no"`` for a yes/no line, one of its choices for a label-set line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlmbatch.inputs.manifest import iter_manifest, read_policy
from vlmbatch.jobs.folder import STORE_FILE, is_job, require_job
from vlmbatch.jobs.store import JobStore
from vlmbatch.pipeline.questions import ManifestError, brief, check_id
from vlmbatch.pipeline.records import ImageItem

Key = tuple[str, str]  # (image id, question id)


@dataclass(frozen=True)
class Label:
    expected: str
    where: str  # "labels.jsonl:3", "manifest.jsonl:3" or the policy's path


@dataclass(frozen=True)
class Scored:
    """One result line, as ``eval``/``calibrate``/``report`` read it. ``answer``: "yes"/"no"
    for a yes/no line, the label for a label-set line, None when failed; ``probs``: a
    label-set line's (choice, probability) pairs in the choices' order, else None."""
    image_id: str
    question_id: str
    question: str
    answer: str | None
    p_yes: float | None
    probs: tuple[tuple[str, float], ...] | None
    error: str | None
    error_kind: str | None
    where: str
    seconds: tuple[float, ...] | None = None  # a clip's line: the frames the model saw

    @property
    def is_label_set(self) -> bool:
        return self.probs is not None

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(c for c, _ in self.probs or ())

    @property
    def confidence(self) -> float | None:
        """The probability of the answer given: P(yes) or 1 - P(yes); a label's own."""
        if self.probs is not None:
            return dict(self.probs).get(self.answer or "")
        if self.p_yes is None:
            return None
        return self.p_yes if self.answer == "yes" else 1.0 - self.p_yes


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scored(d: object, where: str) -> Scored:
    """A result line (a parsed JSON object) as ``Scored``; ManifestError naming ``where``
    when it is not one of ours."""
    if not isinstance(d, dict) or "question_id" not in d or "id" not in d:
        hint = (" (an OpenAI batch output line: give the job folder instead)"
                if isinstance(d, dict) and "custom_id" in d else "")
        raise ManifestError(f"{where}: not a vlmbatch result line (no 'id' and 'question_id')"
                            f"{hint}")
    p_yes, probs, error = d.get("p_yes"), d.get("probs"), d.get("error")
    if p_yes is not None and not (_number(p_yes) and 0.0 <= p_yes <= 1.0):
        raise ManifestError(f"{where}: p_yes must be a probability or null, got {brief(p_yes)}")
    if error is not None and not isinstance(error, str):
        raise ManifestError(f"{where}: error must be a string or null, got {brief(error)}")
    pairs = None if probs is None else _probs(probs, where)
    answer = d.get("label") if pairs is not None else d.get("answer")
    if error is None and pairs is None and (p_yes is None or answer not in ("yes", "no")):
        raise ManifestError(f"{where}: an answered line needs p_yes and answer yes/no, or a "
                            f"label and probs; got answer {brief(answer)}, p_yes {brief(p_yes)}")
    if error is None and pairs is not None and answer not in dict(pairs):
        raise ManifestError(f"{where}: label {brief(answer)} is not one of its probs' choices")
    return Scored(check_id(d["id"], where, "id"), check_id(d["question_id"], where,
                  "question_id"), str(d.get("question", "")), None if error else answer,
                  None if error else p_yes, None if error else pairs, error,
                  d.get("error_kind"), where, _seconds(d.get("seconds")))


def _seconds(v: object) -> tuple[float, ...] | None:
    """A clip's line's ``seconds`` (numbers), else None (a line without, or not a list)."""
    if not isinstance(v, list) or not all(_number(x) for x in v):
        return None
    return tuple(float(x) for x in v)


def _probs(probs: object, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(probs, dict) or not probs or not all(
            isinstance(k, str) and _number(v) and 0.0 <= v <= 1.0 for k, v in probs.items()):
        raise ManifestError(f"{where}: probs must map each choice to a probability, got "
                            f"{brief(probs)}")
    return tuple((k, float(v)) for k, v in probs.items())


def read_results(path: Path) -> Iterator[Scored]:
    """Every result line of a results JSONL file or of a job folder's store, in order."""
    path = Path(path)
    if path.is_dir():
        yield from _job_results(path)
        return
    if not path.is_file():
        raise ManifestError(f"results {path} not found (give a results .jsonl or a job folder)")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip() and not _is_part(d := _json(line, f"{path}:{lineno}")):
                yield scored(d, f"{path}:{lineno}")


def _job_results(job: Path) -> Iterator[Scored]:
    require_job(job)
    store = JobStore(job / STORE_FILE)
    try:
        for n, d in enumerate(store.records(), 1):
            if not _is_part(d):
                yield scored(d, f"{job}: result {n}")
    finally:
        store.close()


def _is_part(d: object) -> bool:
    """A part's line (a clip's window, an image asked alone: ``pipeline/parts.py``): read
    are its item's lines, one per question, which carry the answer."""
    return isinstance(d, dict) and "part" in d


def _json(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON ({str(e)[:120]})") from None


def read_labels(path: Path, policy: Path | None = None) -> dict[Key, Label]:
    """The labels of a labels file or of a labelled manifest (with ``policy``'s questions):
    (image id, question id) -> ``Label``. A pair labelled twice is a ManifestError naming
    both lines."""
    path = Path(path)
    if is_job(path):
        raise ManifestError(f"{path} is a job folder: labels come from a labels .jsonl or the "
                            "manifest with 'expected' on its questions")
    if _is_manifest(path):
        return labelled_manifest(path, policy)[1]
    if policy is not None:
        raise ManifestError(f"{path} is a labels file: a policy applies to a manifest's images")
    out: dict[Key, Label] = {}
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                where = f"{path}:{lineno}"
                key, label = _label_line(_json(line, where), where)
                _add(out, key, label)
    if not out:
        raise ManifestError(f"labels {path} has no labels")
    return out


def _is_manifest(path: Path) -> bool:
    """A manifest line has an "image", "images" or "video" (or is an OpenAI request); a
    labels line has none of them."""
    if not path.is_file():
        raise ManifestError(f"labels {path} not found")
    with path.open(encoding="utf-8-sig") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        d = json.loads(first)
    except (ValueError, RecursionError):
        return False  # read as labels: the error names the line
    return isinstance(d, dict) and any(k in d for k in ("image", "images", "video",
                                                        "custom_id"))


def _label_line(d: object, where: str) -> tuple[Key, Label]:
    if not isinstance(d, dict) or not {"id", "question_id", "expected"} <= d.keys():
        raise ManifestError(f'{where}: a labels line is {{"id", "question_id", "expected"}}, '
                            f"got {brief(d)}")
    expected = d["expected"]
    if not isinstance(expected, str) or not expected:
        raise ManifestError(f"{where}: expected must be a non-empty string (yes, no, or one "
                            f"of the question's choices), got {brief(expected)}")
    key = (check_id(d["id"], where, "id"), check_id(d["question_id"], where, "question_id"))
    return key, Label(expected, where)


def _add(out: dict[Key, Label], key: Key, label: Label) -> None:
    if key in out:
        raise ManifestError(f"{label.where}: image {key[0]!r} question {key[1]!r} is labelled "
                            f"twice (first on {out[key].where})")
    out[key] = label


def labelled_manifest(path: Path, policy: Path | None = None
                      ) -> tuple[list[ImageItem], dict[Key, Label]]:
    """A manifest's items asked only their labelled questions (items with none left out),
    and those labels: what ``vlmbatch eval MANIFEST`` runs and scores. A ``policy``
    question with the id of a line's question is that question, asked at the policy's
    threshold (``inputs/manifest.py`` ``merged``: how a calibration is checked on another
    labelled set); the policy's other questions are asked of every image."""
    qs = read_policy(policy) if policy is not None else ()
    by_id = {q.id: q for q in qs}
    items: list[ImageItem] = []
    labels: dict[Key, Label] = {}
    seen: dict[str, int] = {}
    for lineno, item in iter_manifest(Path(path), qs, merge=True):
        if (first := seen.setdefault(item.id, lineno)) != lineno:
            raise ManifestError(f"{path}:{lineno}: id {brief(item.id)} appears twice (first "
                                f"on line {first})")
        asked = tuple(q for q in item.questions if q.expected is not None)
        for q in asked:  # a label the policy gave names the policy, one the line gave the line
            given = by_id.get(q.id)
            where = str(policy) if given is not None and given.expected == q.expected \
                else f"{path}:{lineno}"
            _add(labels, (item.id, q.id), Label(str(q.expected), where))
        if asked:
            items.append(ImageItem(item.id, item.image, asked, item.base_dir))
    if not labels:
        raise ManifestError(f"{path}: no question carries 'expected' (the label to score "
                            "against)" + (f", nor does {policy}" if policy else ""))
    return items, labels
