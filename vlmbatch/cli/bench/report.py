"""``vlmbatch bench``'s table and JSON: per row QPM, images/s, LLM tokens prefilled per
question, the prefix cache's block hit rate and peak memory; the JSON adds the machine (CPU
model, cores, load average, GPU), the versions (vlmbatch, torch, transformers) and the
options the bench ran with."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmbatch.cli.bench.config import BenchConfig
from vlmbatch.jobs.config import to_json


@dataclass(frozen=True)
class BenchRow:
    """One measured row (the best of its rounds)."""
    name: str
    swept: dict[str, Any]
    dtype: str  # the dtype the row's model ran in (``--dtype auto`` resolved)
    seconds: float
    questions: int
    images: int
    prefill_per_question: float | None  # None: not counted (the baseline's are all tokens)
    hit_rate: float | None  # None: no prefix cache
    peak_rss_mib: float
    peak_gpu_mib: float | None  # None: not on CUDA

    @property
    def qpm(self) -> float:
        return 60.0 * self.questions / self.seconds

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    def as_json(self) -> dict[str, Any]:
        return {"row": self.name, "swept": self.swept, "dtype": self.dtype,
                "seconds": self.seconds, "qpm": self.qpm, "images_per_s": self.images_per_s,
                "prefill_tokens_per_question": self.prefill_per_question,
                "hit_rate": self.hit_rate, "peak_rss_mib": self.peak_rss_mib,
                "peak_gpu_mib": self.peak_gpu_mib}


def bench_table(rows: list[BenchRow]) -> str:
    """The rows as a text table; ``x first`` is each row's QPM over the first row's."""
    w = max(12, *(len(r.name) for r in rows)) + 2
    gpu = any(r.peak_gpu_mib is not None for r in rows)
    head = (f"{'row':<{w}}{'dtype':>10}{'QPM':>10}{'x first':>9}{'images/s':>10}"
            f"{'prefill/q':>11}{'hit rate':>10}{'peak RSS MiB':>14}"
            + (f"{'peak GPU MiB':>14}" if gpu else ""))
    lines = [head]
    for r in rows:
        pre = "-" if r.prefill_per_question is None else f"{r.prefill_per_question:.1f}"
        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.2f}"
        line = (f"{r.name:<{w}}{r.dtype:>10}{r.qpm:>10.0f}{r.qpm / rows[0].qpm:>9.2f}"
                f"{r.images_per_s:>10.2f}{pre:>11}{hit:>10}{r.peak_rss_mib:>14.0f}")
        if gpu:
            line += f"{r.peak_gpu_mib or 0:>14.0f}"
        lines.append(line)
    return "\n".join(lines)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str, load_before: tuple[float, ...]) -> dict[str, Any]:
    """Where the bench ran: CPU, cores, threads, load average before and after, GPU."""
    out: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
        "platform": platform.platform(), "device": device}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def report_json(cfg: BenchConfig, rows: list[BenchRow], source: str,
                load_before: tuple[float, ...]) -> dict[str, Any]:
    return {"machine": machine(cfg.model.device, load_before),
            "versions": {"vlmbatch": _version("vlmbatch"), "torch": torch.__version__,
                         "transformers": _version("transformers"),
                         "python": platform.python_version()},
            "options": to_json(cfg), "workload": source, "rows": [r.as_json() for r in rows]}
