"""``vlmbatch review export JOB``: a job's answers as Label Studio tasks, most borderline first.

One task per image (``build_tasks``)::

    {"data": {"image": URL, "image_id": "a1", "p_yes": {"red": 0.41, ...}},
     "predictions": [{"model_version": "default_model@3f9c.../float32/none", "score": 0.36,
                      "result": [{"from_name": "red", "to_name": "image",
                                  "type": "choices", "value": {"choices": ["no"]}}, ...]}]}

- ``data.image``: the image's URL where it has one (http(s), s3/gs/az: Label Studio reads
  those itself, an object store through a cloud storage connected to the project); a local
  file as a URL of Label Studio's local-files storage, ``/data/local-files/?d=PATH`` with
  PATH relative to ``LOCAL_FILES_DOCUMENT_ROOT`` (``document_root``; docs/labels.md says how
  to start Label Studio so that it serves them: it serves a file only from a folder that a
  project's local-files storage names, which ``studio.py`` connects with ``--url``). A
  table's row or a shard's member has no URL: such images are skipped, and counted.
- one prediction: the model's choice for every question asked of the image (a yes/no
  question: a Choices control of ``yes``/``no``; a label set: one over its labels), the
  control named by the question's id (``label_config``);
- ``model_version``: the job's model fingerprint (``models/fingerprint.py``);
- ``score``: how far the task is from changing an answer, the smallest over its questions
  of the distance of P(yes)'s log-odds from the threshold's (a label set: ``log(p1/p2)`` of
  its top two; ``job_stats.distance``, the report's borderline rule). Label Studio sorts
  tasks by prediction score lowest first, so the most borderline image comes first.

Filters: ``questions`` (only those, in the tasks and the configuration), ``borderline``
(only tasks scoring <= D), ``limit`` (the N lowest scores). Failed answers carry no
prediction; an image none of whose questions was answered is left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlparse
from xml.sax.saxutils import quoteattr

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.jobs.folder import STORE_FILE, job_task_name, load_config, require_job
from vlmbatch.jobs.store import JobStore, image_item_from_json
from vlmbatch.labels.job_stats import distance
from vlmbatch.labels.read import Scored, scored
from vlmbatch.models.fingerprint import fingerprint
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.preprocessing.sources import scheme

IMAGE = "image"  # the Image object's name, and the task data key holding its URL
IMAGE_ID = "image_id"  # the task data key holding the image's id in the job
P_YES = "p_yes"  # ... the model's P(yes) per question (a label set: its probs)
DATA_KEYS = (IMAGE, IMAGE_ID, P_YES)
# names a question id cannot take as a control: the task's data keys (a JSON_MIN export puts
# both side by side) and JSON_MIN's own keys
RESERVED = frozenset({*DATA_KEYS, "id", "annotator", "annotation_id", "created_at",
                      "updated_at", "lead_time", "agreement", "drafts", "predictions", "meta"})
LOCAL_FILES = "/data/local-files/?d="  # Label Studio's local-files storage URL prefix
URL_SCHEMES = ("http", "https", "s3", "gs", "az", "azure-blob")


@dataclass(frozen=True)
class Control:
    """One question as a Choices control: its name (the question id), text and choices."""
    name: str
    text: str
    choices: tuple[str, ...]


@dataclass
class Exported:
    """What ``build_tasks`` made: the tasks (sorted, filtered), the controls they use, and
    the images left out, by why."""
    tasks: list[dict[str, Any]]
    controls: list[Control]
    model_version: str
    skipped: dict[str, int] = field(default_factory=dict)
    folders: set[Path] = field(default_factory=set)  # where the local images exported are


def job_fingerprint(job: Path) -> str:
    """The fingerprint of the model a job answers with: the one its store recorded at submit
    (``model_fingerprint``), else derived now from its config (weights, dtype, quantisation:
    right unless the checkpoint was changed in place since)."""
    store = JobStore(Path(job) / STORE_FILE)
    try:
        recorded = store.get("model_fingerprint")
    finally:
        store.close()
    if recorded:
        return recorded
    m = load_config(job).model
    quant = m.quant if m.quant != "none" else m.llm_quant
    return fingerprint(m.model_dir, m.dtype, quant)


def local_path(item: ImageItem) -> Path | None:
    """Where ``item``'s image is on this machine (absolute); None when it is not a file."""
    src = item.image
    if not isinstance(src, str) or src.startswith("data:"):
        return None
    s = scheme(src)
    if s not in ("", "file"):
        return None
    path = Path(unquote(urlparse(src).path)) if s == "file" else Path(src)
    return (item.base_dir / path).resolve()


def image_url(item: ImageItem, document_root: Path) -> str | None:
    """The URL Label Studio shows ``item``'s image from; None for an image with none (a
    table's row, a shard's member, a data: URL) or a local file outside ``document_root``."""
    if isinstance(item.image, str) and scheme(item.image) in URL_SCHEMES:
        return item.image
    path = local_path(item)
    if path is None:
        return None
    try:
        rel = path.relative_to(Path(document_root).resolve())
    except ValueError:
        return None
    return LOCAL_FILES + quote(rel.as_posix(), safe="/")


def _result(s: Scored) -> dict[str, Any]:
    return {"from_name": s.question_id, "to_name": IMAGE, "type": "choices",
            "value": {"choices": [s.answer]}}


def _task(item: ImageItem, lines: list[Scored], url: str, model_version: str
          ) -> tuple[float, dict[str, Any]]:
    thresholds = {q.id: q.threshold for q in item.questions}
    score = min(distance(s, thresholds.get(s.question_id, 0.5)) for s in lines)
    p_yes = {s.question_id: s.p_yes if s.probs is None else dict(s.probs) for s in lines}
    task = {"data": {IMAGE: url, IMAGE_ID: item.id, P_YES: p_yes},
            "predictions": [{"model_version": model_version, "score": round(score, 6),
                             "result": [_result(s) for s in lines]}]}
    return score, task


def _answered(job: Path, questions: Sequence[str]) -> Iterator[tuple[ImageItem, list[Scored]]]:
    """Each recorded item with its answered lines (of ``questions``, if any named)."""
    store = JobStore(Path(job) / STORE_FILE)
    try:
        for item, lines in store.recorded_items(image_item_from_json):
            got = [scored(d, f"{job}: item {item.id!r}") for d in lines]
            yield item, [s for s in got if s.error is None and s.answer is not None
                         and (not questions or s.question_id in questions)]
    finally:
        store.close()


def build_tasks(job: Path, document_root: Path = Path("/"), questions: Sequence[str] = (),
                borderline: float | None = None, limit: int | None = None) -> Exported:
    """The job's tasks, lowest score (most borderline) first, filtered; ManifestError for an
    embedding job, a question named that the job never asked, or no task left."""
    require_job(job)
    if job_task_name(job) != "answer":
        raise ManifestError(f"{job} is an embedding job: review covers jobs that answer "
                            "questions")
    version = job_fingerprint(job)
    scored_tasks: list[tuple[float, int, dict[str, Any]]] = []
    controls: dict[str, Control] = {}
    skipped: dict[str, int] = {}
    folders: set[Path] = set()
    for n, (item, lines) in enumerate(_answered(job, questions)):
        if not lines:
            skipped["no answer"] = skipped.get("no answer", 0) + 1
            continue
        url = image_url(item, document_root)
        if url is None:
            skipped["no URL"] = skipped.get("no URL", 0) + 1
            continue
        if url.startswith(LOCAL_FILES):
            folders.add(Path(str(local_path(item))).parent)
        for s in lines:
            if s.question_id in RESERVED:
                raise ManifestError(f"{job}: question id {s.question_id!r} is a name Label "
                                    "Studio's exports use for something else; submit the job "
                                    "with another id for that question")
            controls.setdefault(s.question_id, Control(
                s.question_id, s.question, s.choices if s.probs is not None else ("yes", "no")))
        score, task = _task(item, lines, url, version)
        if borderline is None or score <= borderline:
            scored_tasks.append((score, n, task))
    _check_named(questions, controls, job)
    scored_tasks.sort(key=lambda t: (t[0], t[1]))
    tasks = [t for _, _, t in scored_tasks[:limit]]
    if not tasks:
        raise ManifestError(f"{job}: no task to export" + (
            f" within log-odds {borderline} of a threshold" if borderline is not None else "")
            + (f" ({', '.join(f'{v} {k}' for k, v in skipped.items())})" if skipped else ""))
    return Exported(tasks, list(controls.values()), version, skipped, folders)


def _check_named(questions: Sequence[str], controls: dict[str, Control], job: Path) -> None:
    missing = [q for q in questions if q not in controls]
    if missing:
        raise ManifestError(f"--questions {','.join(missing)}: {job} has no answer to "
                            f"{'it' if len(missing) == 1 else 'them'} (its questions: "
                            f"{', '.join(controls) or 'none answered'})")


def label_config(controls: Sequence[Control]) -> str:
    """The labelling configuration (XML) of a project for these tasks: the image, then per
    question its text and a single-choice Choices control named by its id."""
    parts = ["<View>", f'  <Image name="{IMAGE}" value="${IMAGE}" zoom="true"/>']
    for c in controls:
        parts.append(f"  <Header value={quoteattr(c.text)}/>")
        parts.append(f"  <Choices name={quoteattr(c.name)} toName=\"{IMAGE}\" "
                     'choice="single-radio" showInline="true">')
        parts += [f"    <Choice value={quoteattr(v)}/>" for v in c.choices]
        parts.append("  </Choices>")
    parts.append("</View>")
    return "\n".join(parts) + "\n"


def write_text(text: str, out: Path) -> None:
    """``text`` into ``out``, whole or not at all."""
    with replaced_on_success(Path(out)) as part:
        Path(part).write_text(text, encoding="utf-8")


def tasks_json(tasks: list[dict[str, Any]]) -> str:
    """The tasks as Label Studio imports them: one JSON list."""
    return json.dumps(tasks, indent=1, ensure_ascii=False) + "\n"
