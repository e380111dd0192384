"""A changed policy costs what changed: answers copied from an earlier job (``submit ...
--reuse OLD_JOB``, ``run JOB --reuse OLD_JOB``) instead of computed again.

An answer of the earlier job is reused for a pending item's question when all of these are
the same (``Reuse.of``):

- the image's **content**: a SHA-256 of its bytes (a local path, ``file://`` or ``data:``
  URL; an image reached over the network, a table's row or a shard's member is computed);
  an earlier job's file modified after that job was submitted is not trusted (its answer may
  be of the older content);
- the **question**: its text, choices, instruction, system turn and ``max_new_tokens`` (its
  id and its threshold may differ: the answer is re-decided from the stored P(yes) at the
  new threshold; its label is not part of the answer);
- the **model**: its fingerprint (``models/fingerprint.py``: the weights' and config's hash,
  dtype, quantisation) and what turns an image and a question into an answer: the tiling
  (``max_tiles``, ``tiling``, ``upscale_limit``, ``max_image_tokens``), ``max_pixels``, the
  vision runner, the answer words, the label-set scoring, generation (``identity``). Any
  difference there and nothing is reused, whatever else matches.

An item whose every question is reused is recorded at once, without being prepared; one with
new or reworded questions goes to the engine with those only, once for all of them, and its
reused lines are put back in its questions' order when it is recorded (``merge``). The store
counts the answers reused (meta ``reused_answers``; ``status`` says it).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import STORE_FILE, job_task_name, load_config, require_job
from vlmbatch.jobs.store import JobStore, image_item_from_json
from vlmbatch.models.fingerprint import fingerprint
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import ImageItem, Question
from vlmbatch.preprocessing.sources import SourceError, read_bytes, scheme

QuestionKey = tuple[str, tuple[str, ...], str | None, str | None, int | None]


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What, beside the image and the question, decides an answer (``cfg``'s model fingerprint
    and the settings that change what the model sees or how it answers)."""
    m, e = cfg.model, cfg.engine
    quant = m.quant if m.quant != "none" else m.llm_quant
    return {"model": fingerprint(m.model_dir, m.dtype, quant),
            "preprocessing": {"max_tiles": m.max_tiles, "tiling": m.tiling,
                              "upscale_limit": m.upscale_limit,
                              "max_image_tokens": m.max_image_tokens,
                              "max_pixels": cfg.prepare.max_pixels},
            "answer": {"engine": e.engine, "vit_backend": e.vit_backend,
                       "yes_words": list(e.yes_words), "no_words": list(e.no_words),
                       "choice_scoring": e.choice_scoring, "max_new_tokens": e.max_new_tokens,
                       "ignore_eos": e.ignore_eos}}


def question_key(q: Question) -> QuestionKey:
    return (q.text, tuple(q.choices), q.system, q.prompt, q.max_new_tokens)


def bytes_hash(item: ImageItem, not_after: float | None = None) -> str | None:
    """SHA-256 of the item's image bytes; None for an image not read from this machine, one
    unreadable, or (``not_after``) a file modified after that time."""
    src = item.image
    if not isinstance(src, str) or scheme(src) not in ("", "file", "data"):
        return None
    try:
        if not_after is not None and not src.startswith("data:"):
            path = Path(src[len("file://"):] if src.startswith("file://") else src)
            if (item.base_dir / path).stat().st_mtime > not_after:
                return None
        return hashlib.sha256(read_bytes(src, item.base_dir)).hexdigest()
    except (SourceError, OSError):
        return None


def redecided(line: dict[str, Any], q: Question, image_id: str) -> dict[str, Any]:
    """An earlier job's line as this job's: its ids, and a yes/no answer decided again at
    this question's threshold from the stored P(yes)."""
    out = {**line, "id": image_id, "question_id": q.id, "question": q.text}
    if out.get("p_yes") is not None and not q.choices:
        out["answer"] = "yes" if out["p_yes"] >= q.threshold else "no"
    return out


@dataclass
class Reuse:
    """The earlier job's answers by (image content, question); empty when its model or its
    settings differ (``why_not`` says how)."""
    source: Path
    answers: dict[str, dict[QuestionKey, dict[str, Any]]] = field(default_factory=dict)
    why_not: str | None = None

    @classmethod
    def open(cls, old: Path, cfg: RunConfig) -> Reuse:
        require_job(old)
        if job_task_name(old) != "answer":
            raise ManifestError(f"--reuse {old}: an embedding job has no answers to reuse")
        mine, theirs = identity(cfg), identity(load_config(old))
        if mine != theirs:
            diff = [f"{k}.{n}" for k in mine for n in mine[k]
                    if not isinstance(mine[k], dict) or mine[k][n] != theirs[k][n]] \
                if mine["model"] == theirs["model"] else ["model"]
            return cls(Path(old), why_not=f"{', '.join(diff)} differ")
        return cls(Path(old), _index(Path(old)))

    def of(self, item: ImageItem) -> dict[str, dict[str, Any]]:
        """Question id -> the reused line, for the item's questions found."""
        if not self.answers:
            return {}
        found = self.answers.get(bytes_hash(item) or "")
        if not found:
            return {}
        return {q.id: redecided(found[k], q, item.id) for q in item.questions
                if (k := question_key(q)) in found}


def _index(old: Path) -> dict[str, dict[QuestionKey, dict[str, Any]]]:
    """The earlier job's answered lines by image content and question."""
    store = JobStore(old / STORE_FILE)
    try:
        created = float(store.get("created") or 0.0) or None
        out: dict[str, dict[QuestionKey, dict[str, Any]]] = {}
        for item, lines in store.recorded_items(image_item_from_json):
            by_id = {q.id: q for q in item.questions}
            answered = [d for d in lines if d.get("error") is None and d["question_id"] in by_id]
            h = bytes_hash(item, created) if answered else None
            if h is not None:
                slot = out.setdefault(h, {})
                for d in answered:
                    slot.setdefault(question_key(by_id[d["question_id"]]), d)
        return out
    finally:
        store.close()


@dataclass(frozen=True)
class Line:
    """A reused line as ``JobStore.record`` takes it."""
    d: dict[str, Any]
    error = None

    def record(self) -> dict[str, Any]:
        return self.d


@dataclass
class Pass:
    """What reuse did before a run: the items recorded whole, and the reused lines kept for
    the items that still have questions to compute (item id -> question id -> line)."""
    partial: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    order: dict[str, tuple[str, ...]] = field(default_factory=dict)  # item id -> question ids
    whole: int = 0
    reused: int = 0

    def strip(self, item: ImageItem) -> ImageItem:
        """The item with only the questions left to compute."""
        kept = self.partial.get(item.id)
        if not kept:
            return item
        return dataclasses.replace(item, questions=tuple(q for q in item.questions
                                                         if q.id not in kept))

    def merge(self, item_id: str, results: list[Any]) -> list[Any]:
        """An item's computed results with its reused lines, in its questions' order."""
        kept = self.partial.get(item_id)
        if not kept:
            return results
        by_q = {r.record()["question_id"]: r for r in results}
        return [by_q[q] if q in by_q else Line(kept[q]) for q in self.order[item_id]
                if q in by_q or q in kept]


def count_reused(store: JobStore, n: int) -> None:
    """Add ``n`` reused answers recorded to the store's count (``status`` shows it)."""
    if n:
        store.set("reused_answers", str(int(store.get("reused_answers") or 0) + n))


def reuse_pass(store: JobStore, reuse: Reuse, batch: int = 256) -> Pass:
    """Record the pending items every question of which is reused (counted in the store's
    ``reused_answers``); keep the reused lines of the others (counted when recorded)."""
    out = Pass()
    for group in store.pending(batch):
        whole: dict[str, list[Line]] = {}
        for item in group:
            got = reuse.of(item)
            if got and len(got) == len(item.questions):
                whole[item.id] = [Line(got[q.id]) for q in item.questions]
            elif got:
                out.partial[item.id] = got
                out.order[item.id] = tuple(q.id for q in item.questions)
            out.reused += len(got)
        if whole:
            store.record(whole)
            out.whole += len(whole)
            count_reused(store, sum(map(len, whole.values())))
    return out

