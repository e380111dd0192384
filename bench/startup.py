"""Start-up of the CLI: ``vlmbatch --help``, ``run --help``, ``status JOB`` and ``results JOB``
beside ``python -c "import torch"`` and an empty interpreter, each a fresh process, run
round-robin (so the machine's load falls on every row alike), median and fastest of
``--rounds``, with the median peak RSS.

The light commands import no torch, transformers, fastapi or OpenCV (``tests/cli/
test_startup.py`` checks that; ``vlmbatch/cli/commands.py`` says how). Target: ``--help``
under 0.5 s; the bench exits 1 when the median misses ``--target-s`` (after the table).
``--before DIR`` adds the same commands run from another source tree of vlmbatch (first on
``PYTHONPATH``), e.g. the commit before the lazy CLI, in the same rounds.

    python bench/startup.py --rounds 15
    git archive a636d83 | tar -x -C /tmp/old && python bench/startup.py --before /tmp/old
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def vlmbatch_cmd() -> list[str]:
    """The console script beside this interpreter (what a user types), else ``-m``."""
    script = Path(sys.executable).parent / "vlmbatch"
    found = str(script) if script.is_file() else shutil.which("vlmbatch")
    return [found] if found else [sys.executable, "-m", "vlmbatch"]


def make_job(tmp: Path) -> Path:
    """A job of the example manifest, answered (``vlmbatch submit --wait``, not timed)."""
    job = tmp / "job"
    subprocess.run([*vlmbatch_cmd(), "submit", str(ROOT / "examples/manifest.jsonl"),
                    "--policy", str(ROOT / "examples/policy.yaml"), "--job", str(job),
                    "--wait", "--no-progress"], check=True, capture_output=True)
    return job


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one run of ``argv``, its output discarded."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage: its peak RSS
    seconds = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}")
    return seconds, usage.ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--target-s", type=float, default=0.5,
                    help="--help's median must be under this (default %(default)s)")
    ap.add_argument("--before", type=Path, default=None,
                    help="also time --help and status JOB from this vlmbatch source tree")
    args = ap.parse_args()
    cli = vlmbatch_cmd()
    with tempfile.TemporaryDirectory(prefix="vlmbatch-startup-") as tmp:
        job = make_job(Path(tmp))
        rows = {"vlmbatch --help": [*cli, "--help"],
                "vlmbatch run --help": [*cli, "run", "--help"],
                "vlmbatch status JOB": [*cli, "status", str(job)],
                "vlmbatch results JOB (JSONL)": [*cli, "results", str(job)],
                'python -c "import torch"': [sys.executable, "-c", "import torch"],
                'python -c "pass"': [sys.executable, "-c", "pass"]}
        env: dict[str, dict[str, str] | None] = {name: None for name in rows}
        if args.before is not None:
            old = {**os.environ, "PYTHONPATH": str(args.before.resolve())}
            for name in ("vlmbatch --help", "vlmbatch status JOB"):
                rows[f"before: {name}"], env[f"before: {name}"] = rows[name], old
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, argv in rows.items():
                runs[name].append(timed(argv, env[name]))
    print(f"{args.rounds} rounds, round-robin; {' '.join(cli)}; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'command':<32} {'median s':>9} {'fastest s':>10} {'peak RSS MiB':>13}")
    for name, got in runs.items():
        secs = [s for s, _ in got]
        rss = statistics.median(m for _, m in got)
        print(f"{name:<32} {statistics.median(secs):>9.3f} {min(secs):>10.3f} {rss:>13.0f}")
    help_s = statistics.median(s for s, _ in runs["vlmbatch --help"])
    if help_s >= args.target_s:
        print(f"FAILED: vlmbatch --help median {help_s:.3f} s, target < {args.target_s} s",
              file=sys.stderr)
        sys.exit(1)
    print(f"vlmbatch --help: median {help_s:.3f} s, under the {args.target_s} s target")


if __name__ == "__main__":
    main()
