"""A changed policy re-run with ``--reuse`` against the same policy run in full, side by side
in one process, on the built-in model: a finished job asked a 5-question policy of the
labelled example's images; the new policy changes one threshold and replaces one question by
a new one. Prints both wall times (engine building included in each) and their ratio, and
checks the answers are a full run's (exit 1 if not: answers equal, P(yes) within 2e-3).

    python bench/reuse.py --images 48 --threads 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlmbatch.jobs.config import RunConfig  # noqa: E402
from vlmbatch.jobs.folder import STORE_FILE, status  # noqa: E402
from vlmbatch.jobs.job import run_job, submit  # noqa: E402
from vlmbatch.jobs.store import JobStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OLD = [{"id": "red", "text": "Is there a red shape?"},
       {"id": "circle", "text": "Does the image contain a circle?"},
       {"id": "triangle", "text": "Is there a triangle?"},
       {"id": "three", "text": "Are there three shapes?"},
       {"id": "blue", "text": "Is there a blue shape?"}]
NEW = [OLD[0], {**OLD[1], "threshold": 0.01}, OLD[2], OLD[3],
       {"id": "green", "text": "Is there a green shape?"}]


def _job(tmp: Path, name: str, policy: list[dict], n: int, threads: int,
         reuse: Path | None = None) -> tuple[Path, float]:
    images = sorted((ROOT / "examples" / "labelled" / "images").glob("*.png"))[:n]
    (tmp / "m.jsonl").write_text("".join(json.dumps({"id": p.stem, "image": str(p)}) + "\n"
                                         for p in images))
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump({"questions": policy}))
    cfg = RunConfig(manifest=tmp / "m.jsonl", policy=tmp / f"{name}.yaml", threads=threads,
                    progress=False)
    start = time.perf_counter()
    submit(cfg, tmp / name, reuse=reuse)
    run_job(tmp / name, progress=False)
    return tmp / name, time.perf_counter() - start


def _lines(job: Path) -> dict[tuple[str, str], dict]:
    store = JobStore(job / STORE_FILE)
    try:
        return {(d["id"], d["question_id"]): d for d in store.records()}
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vlmbatch-reuse-"))
    try:
        old, t_old = _job(tmp, "old", OLD, a.images, a.threads)
        full, t_full = _job(tmp, "full", NEW, a.images, a.threads)
        reused, t_reuse = _job(tmp, "reused", NEW, a.images, a.threads, reuse=old)
        got, want = _lines(reused), _lines(full)
        bad = [k for k in want if got.get(k, {}).get("answer") != want[k]["answer"]
               or abs(got[k]["p_yes"] - want[k]["p_yes"]) > 2e-3]
        st = status(reused)
        print(f"images {a.images}, questions 5 (1 new, 1 threshold changed), threads "
              f"{a.threads}")
        print(f"first run {t_old:.1f} s; full run of the new policy {t_full:.1f} s; with "
              f"--reuse {t_reuse:.1f} s ({st.reused} reused, {st.questions - st.reused} "
              f"computed): {t_reuse / t_full:.2f}x")
        print(f"answers as the full run's: {len(want) - len(bad)}/{len(want)}")
        if bad:
            sys.exit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
