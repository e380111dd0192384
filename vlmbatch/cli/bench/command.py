"""``vlmbatch bench``: QPM of the engine on the user's model, device, dtype and images, one row
per combination of ``--sweep`` values (plus the batched transformers row with
``--baseline transformers``), printed as a table and written as JSON with ``--json``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from vlmbatch.cli.args import CommandLine
from vlmbatch.cli.bench.config import BenchConfig
from vlmbatch.cli.bench.measure import (
    BaselineRow,
    EngineRow,
    Models,
    baseline_row,
    engine_rows,
    timed_rounds,
)
from vlmbatch.cli.bench.report import BenchRow, bench_table, report_json
from vlmbatch.cli.bench.workload import Workload, workload
from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.common.options import build
from vlmbatch.engine.loading import check_device
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks

EXIT_OK = 0


def cmd_bench(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    cfg = build(BenchConfig, line.typed)
    rows, work = run_bench(cfg)
    print(f"vlmbatch bench: {work.source}, {work.questions} questions, "
          f"{torch.get_num_threads()} threads, device {cfg.model.device}; best of "
          f"{cfg.rounds} rounds")
    print(bench_table(rows))
    return EXIT_OK


def run_bench(cfg: BenchConfig) -> tuple[list[BenchRow], Workload]:
    """Every row measured (``--json``: written too); the workload they answered."""
    load = os.getloadavg()
    check_device(cfg.model.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    variants = cfg.variants()
    with tempfile.TemporaryDirectory(prefix="vlmbatch-bench-") as tmp:
        work = workload(cfg, Path(tmp), max(v.images_per_batch for v in variants))
        models = Models()
        timed: list = engine_rows(variants, work.items, work.warm, models)
        if cfg.baseline == "transformers":
            host = models.get(cfg.model)
            timed.insert(0, baseline_row(host, cfg.model, work.items, work.warm))
        timed_rounds(timed, cfg.rounds)
    rows = [_row(r, work, cfg) for r in timed]
    if cfg.json_out is not None:
        with replaced_on_success(cfg.json_out) as part:
            part.write_text(json.dumps(report_json(cfg, rows, work.source, load), indent=2)
                            + "\n")
        print(f"vlmbatch bench: wrote {cfg.json_out}", file=sys.stderr)
    return rows, work


def _row(r: EngineRow | BaselineRow, work: Workload, cfg: BenchConfig) -> BenchRow:
    n = work.questions
    if isinstance(r, BaselineRow):
        prefill = sum(t for t, _ in r.inner.work.prefills) / n
        return BenchRow(r.name, {}, r.dtype, min(r.times), n, len(work.items), prefill, None,
                   r.rss, None)
    eng = r.last_engine
    hit = eng.cache.stats.hit_rate() if eng.cache is not None else None
    swept = {k: v for k, v in next(v.swept for v in cfg.variants() if v.name == r.name)}
    return BenchRow(r.name, swept, r.dtype, min(r.times), n, len(work.items),
               eng.stats.prefill_tokens / n, hit, r.rss, r.gpu_mib)
