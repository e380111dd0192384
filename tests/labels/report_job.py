"""A job folder for the report's tests, answered without a model: submitted from a manifest of
the labelled example's images (plus one missing and one undecodable image), then recorded
with lines these tests write themselves in the result lines' shape: a yes/no question with
random P(yes) at threshold 0.3 and labels (some wrong), a second one at 0.5, a label-set
question (``label``, ``probs``, ``logprobs``, ``p_yes: null``) and a yes/no question whose
answers are all far from its threshold."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.folder import STORE_FILE
from vlmbatch.jobs.job import submit
from vlmbatch.jobs.store import JobStore

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "examples" / "labelled" / "images").glob("*.png"))
CHOICES = ("safe", "sexual", "violence", "hate")
ODD_TEXT = 'Is it <b>bold</b> & "quoted"?'  # must show escaped


@dataclass(frozen=True)
class Line:
    """A recorded result object (what ``JobStore.record`` takes)."""
    d: dict[str, Any]

    @property
    def error(self) -> str | None:
        return self.d.get("error")

    def record(self) -> dict[str, Any]:
        return self.d


FAR = (0.0002, 0.9998)  # the "far" question's P(yes), alternately: nothing near 0.5


def make_job(tmp: Path, n: int = 30, seed: int = 5) -> tuple[Path, dict[str, list[dict]]]:
    """(the job, each item id's lines as recorded). Question "red" carries labels: "yes"
    where its P(yes) >= 0.3, but wrong for every 7th item."""
    (tmp / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rng = np.random.default_rng(seed)
    drawn = [(rng.random(2).round(4), rng.normal(size=len(CHOICES))) for _ in range(n)]
    red = [("yes" if p[0] >= 0.3 else "no") if k % 7 else ("no" if p[0] >= 0.3 else "yes")
           for k, (p, _) in enumerate(drawn)]
    lines = [{"id": f"i{k:02d}", "image": str(IMAGES[k % len(IMAGES)]), "questions": [
        {"id": "red", "text": "Is there a red shape?", "threshold": 0.3, "expected": red[k]},
        {"id": "odd", "text": ODD_TEXT}, {"id": "category", "text": "Which category?"},
        {"id": "far", "text": "Is it far?"}]} for k in range(n)]
    lines += [{"id": "missing", "image": str(tmp / "nowhere.png"), "questions": ["Red?"]},
              {"id": "broken", "image": str(tmp / "broken.png"), "questions": ["Red?"]}]
    manifest = tmp / "m.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = tmp / "job"
    submit(RunConfig(manifest=manifest), job)
    recorded: dict[str, list[dict]] = {}
    for k, (p, logits) in enumerate(drawn):
        probs = np.exp(logits) / np.exp(logits).sum()
        recorded[f"i{k:02d}"] = [
            _yes_no(f"i{k:02d}", "red", "Is there a red shape?", float(p[0]), 0.3),
            _yes_no(f"i{k:02d}", "odd", ODD_TEXT, float(p[1]), 0.5),
            {"id": f"i{k:02d}", "question_id": "category", "question": "Which category?",
             "answer": None, "label": CHOICES[int(probs.argmax())],
             "probs": dict(zip(CHOICES, map(float, probs))),
             "logprobs": dict(zip(CHOICES, map(float, np.log(probs)))), "p_yes": None,
             "margin": None, "image_tokens": 80, "error": None},
            _yes_no(f"i{k:02d}", "far", "Is it far?", FAR[k % 2], 0.5)]
    for item, kind in (("missing", "source"), ("broken", "decode")):
        recorded[item] = [{"id": item, "question_id": "q0", "question": "Red?", "answer": None,
                           "p_yes": None, "margin": None, "image_tokens": None,
                           "error": f"{item}: cannot read", "error_kind": kind}]
    store = JobStore(job / STORE_FILE)
    try:
        store.begin_run(store.counts(), "test")
        store.record({k: [Line(d) for d in v] for k, v in recorded.items()})
        store.end_run("interrupted")
    finally:
        store.close()
    return job, recorded


def _yes_no(item: str, qid: str, text: str, p: float, threshold: float) -> dict:
    return {"id": item, "question_id": qid, "question": text,
            "answer": "yes" if p >= threshold else "no", "p_yes": p, "margin": 0.0,
            "image_tokens": 80, "error": None}
