"""Job-store status queries on a large job: per-item counts vs parsing every stored result.

``vlmbatch status`` (and every run's start) needs the number of result lines recorded and of
questions answered. ``jobs/store.py`` keeps both per item (columns ``lines``, ``answered``,
written in ``record``'s transaction); the alternative is to parse every item's JSON result with
SQLite's ``json_each``. This fills a temporary store with ``--items`` done items of
``--questions`` result lines each and times both, side by side, in one process, checking
that they agree.

    python bench/store.py --items 1000000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# the repo root first: bench/jobs.py would otherwise shadow the jobs package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs.store import JobStore  # noqa: E402
from jobs.store_schema import ANSWERED_OF_RESULT  # noqa: E402

# what status computed before the per-item columns (and what a migration still computes)
PARSE = (f"SELECT COALESCE(SUM(json_array_length(result)), 0), "
         f"COALESCE(SUM({ANSWERED_OF_RESULT}), 0) FROM items WHERE state != 'pending'")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = JobStore(Path(tmp) / "store.sqlite")
        lines = [{"id": "x", "question_id": f"q{i}", "question": "Is there a red shape?",
                  "answer": "yes", "p_yes": 0.9, "margin": 2.2, "image_tokens": 64,
                  "error": None} for i in range(args.questions)]
        text, n = json.dumps(lines), args.questions
        store.db.execute("BEGIN")
        store.db.executemany(
            "INSERT INTO items (item_id, spec, state, result, lines, answered) "
            "VALUES (?, '{}', 'done', ?, ?, ?)",
            ((f"i{i}", text, n, n) for i in range(args.items)))
        store.db.execute("COMMIT")
        best = {"parse every result (json_each)": float("inf"), "per-item counts": float("inf")}
        for _ in range(args.rounds):  # interleaved, best of rounds
            t = time.perf_counter()
            parsed = tuple(store.db.execute(PARSE).fetchone())
            best["parse every result (json_each)"] = min(best["parse every result (json_each)"],
                                                         time.perf_counter() - t)
            t = time.perf_counter()
            counted = (store.questions_done(), store.questions_answered())
            best["per-item counts"] = min(best["per-item counts"], time.perf_counter() - t)
            assert parsed == counted, (parsed, counted)
        store.close()
    base = best["parse every result (json_each)"]
    print(f"\n{args.items:,} done items x {args.questions} result lines; best of {args.rounds}\n")
    print("| query | seconds | speed-up |\n|---|---|---|")
    for name, s in best.items():
        print(f"| {name} | {s:.3f} | {base / s:.1f}x |")


if __name__ == "__main__":
    main()
