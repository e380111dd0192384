"""Peak memory of a process tree, sampled from /proc (``bench/jobs.py``, and the slow
1,000,000-line test ``tests/jobs/test_scale.py``)."""

from __future__ import annotations

import os
from pathlib import Path


def tree_rss_mib(pid: int) -> float:
    """RSS of ``pid`` and all its descendants (from /proc), MiB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            status = Path(f"/proc/{d}/status").read_text()
        except OSError:
            continue
        fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
        p = int(d)
        children.setdefault(int(fields.get("PPid", "0").strip() or 0), []).append(p)
        rss[p] = int(fields.get("VmRSS", "0 kB").split()[0] or 0)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total / 1024
