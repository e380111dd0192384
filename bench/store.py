"""Job-store status queries on a large job: per-state totals vs per-item counts vs parsing
every stored result.

``vlmbatch status`` (and every run's start) needs the number of result lines recorded and of
questions answered. ``jobs/store.py`` keeps both per state (table ``totals``, kept in the
same transaction as each change, ``jobs/store_schema.py``) and per item (columns ``lines``,
``answered``); before the totals, status summed the columns over every item, and before those
it parsed every item's JSON result with SQLite's ``json_each``. This fills a temporary store
with ``--items`` done items of ``--questions`` result lines each and times the three, side
by side, in one process, checking that they agree (exit 1 after the table if not).

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
from bench.checks import Checks  # noqa: E402
from vlmbatch.jobs.store import JobStore  # noqa: E402
from vlmbatch.jobs.store_schema import ANSWERED_OF_RESULT  # noqa: E402

# what status computed before the per-item columns (and what a migration still computes)
PARSE = (f"SELECT COALESCE(SUM(json_array_length(result)), 0), "
         f"COALESCE(SUM({ANSWERED_OF_RESULT}), 0) FROM items WHERE state != 'pending'")
# what status computed before the per-state totals
SUMS = ("SELECT COALESCE(SUM(lines), 0), COALESCE(SUM(answered), 0) FROM items "
        "WHERE state != 'pending'")


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
        # inserted done, not through add_items: the per-state totals are filled in once
        store.db.execute("UPDATE totals SET (items, lines, answered) = (SELECT COUNT(*), "
                         "COALESCE(SUM(lines), 0), COALESCE(SUM(answered), 0) FROM items "
                         "WHERE items.state = totals.state)")
        store.db.execute("COMMIT")
        queries = {"parse every result (json_each)": lambda: tuple(
                       store.db.execute(PARSE).fetchone()),
                   "sum the per-item counts": lambda: tuple(store.db.execute(SUMS).fetchone()),
                   "per-state totals (status now)": lambda: (store.questions_done(),
                                                             store.questions_answered())}
        best = dict.fromkeys(queries, float("inf"))
        answers: set[tuple] = set()
        for _ in range(args.rounds):  # interleaved, best of rounds
            for name, query in queries.items():
                t = time.perf_counter()
                answers.add(query())
                best[name] = min(best[name], time.perf_counter() - t)
        store.close()
    base = best["parse every result (json_each)"]
    print(f"\n{args.items:,} done items x {args.questions} result lines; best of {args.rounds}\n")
    print("| query | time | speed-up |\n|---|---|---|")
    for name, s in best.items():
        print(f"| {name} | {s * 1e3:.2f} ms | {base / s:,.0f}x |")
    checks = Checks()
    what = f"the three queries give the same (lines, answered): {sorted(answers)}"
    print(f"\ncheck: {what} {checks.verdict(len(answers) == 1, what)}")
    checks.exit()


if __name__ == "__main__":
    main()
