"""CPU seconds of one stretch of this process's work, split by who spent them: each Python
thread started meanwhile, by the prefix of its name (``vlmbatch-fetch``: the fetch stage;
``vlmbatch-decoder``: the threads handing images to the decoder processes and copying their
tiles out; ...), the main thread (the drive loop and the model's Python), the rest of this
process (native threads: torch's intra-op pool), and the child processes reaped meanwhile
(the decoder processes, killed and reaped when a run stops its pool). ``process_cpu``: another
process's (a server's, Linux).

Exact, not sampled: a thread's CPU clock is read as its ``run`` returns (``Thread.run``
wrapped while a ``ThreadCpu`` is open), the process's and its reaped children's from
``getrusage``. A stretch ends by joining the threads it started, so none is missed.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuSplit:
    """Seconds: ``threads`` by name prefix (``main`` the main thread, ``native`` what this
    process spent outside its Python threads), ``children`` its reaped child processes'."""
    threads: dict[str, float]
    children: float

    @property
    def process(self) -> float:
        return sum(self.threads.values())


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads, in clock ticks) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kind(name: str) -> str:
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def _rusage(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class ThreadCpu:
    """``with ThreadCpu() as cpu: ... cpu.measure(fn)``: ``fn()``'s result and its
    ``CpuSplit``. Call from the main thread; one stretch at a time."""

    def __init__(self) -> None:
        self.done: list[tuple[threading.Thread, float]] = []
        self.started: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.run = threading.Thread.run

    def __enter__(self) -> ThreadCpu:
        meter, run = self, self.run

        def counted(thread: threading.Thread) -> None:
            with meter.lock:
                meter.started.append(thread)
            try:
                run(thread)
            finally:
                with meter.lock:
                    meter.done.append((thread, time.thread_time()))

        threading.Thread.run = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        threading.Thread.run = self.run  # type: ignore[method-assign]

    def measure(self, fn, join_s: float = 30.0):  # noqa: ANN001, ANN201
        with self.lock:
            self.started, self.done = [], []
        proc, kids, main = _rusage(resource.RUSAGE_SELF), _rusage(resource.RUSAGE_CHILDREN), \
            time.thread_time()
        result = fn()
        for t in list(self.started):
            t.join(join_s)  # a pool's threads end once it is stopped
        main = time.thread_time() - main
        proc = _rusage(resource.RUSAGE_SELF) - proc
        kids = _rusage(resource.RUSAGE_CHILDREN) - kids
        split: Counter[str] = Counter({"main": main})
        with self.lock:
            alive = [t.name for t in self.started if t.is_alive()]
            for t, cpu in self.done:
                split[_kind(t.name)] += cpu
        if alive:
            raise RuntimeError(f"threads still running after the stretch: {alive}")
        split["native"] = max(proc - sum(split.values()), 0.0)
        return result, CpuSplit(dict(split), kids)
