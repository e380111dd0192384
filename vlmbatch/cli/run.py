"""In-process run of a manifest (``vlmbatch run MANIFEST``): items -> answers -> JSONL (or
CSV) results, with progress.

``run(config)`` validates every input before loading the model, then takes items in groups of
``images_per_batch`` through the drive loop (``pipeline/drive.py``: preprocessing threads
prepare the next groups while the model answers this one); each group's answers are
written and flushed before the next group's are, so an interrupted run keeps whole lines.
Jobs (``jobs/job.py``) run the same loop over a job store.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import IO

from tqdm import tqdm

from vlmbatch.engine.base import EngineSummary
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.loading import check_label_sets
from vlmbatch.inputs.datasets import iter_dataset
from vlmbatch.inputs.manifest import (
    items_from_folder,
    label_sets,
    manifest_format,
    read_manifest,
    read_policy,
)
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.tasks import checked, prompt_limits
from vlmbatch.outputs.sinks import GroupWriter, format_of, has_clips
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.pipeline.task import AnswerTask


@dataclass(frozen=True)
class RunSummary:
    images: int
    questions: int
    failed_images: int
    failed_questions: int
    seconds: float
    engine: EngineSummary

    @property
    def qpm(self) -> float:
        return 60.0 * (self.questions - self.failed_questions) / max(self.seconds, 1e-9)

    def text(self) -> str:
        answered = max(self.questions - self.failed_questions, 1)
        e = self.engine
        cache = ("off" if e.cache_hit_rate is None
                 else f"block hit rate {e.cache_hit_rate:.2f}")
        return (f"{self.images} images, {self.questions} questions, "
                f"{self.failed_images} images failed ({self.failed_questions} questions), "
                f"{self.seconds:.1f}s, {self.qpm:.0f} QPM; prefill "
                f"{e.prefill_tokens / answered:.0f} of {e.prompt_tokens / answered:.0f} "
                f"prompt tokens per question (prefix cache {cache})"
                + (f"; vision CUDA graphs: {e.graph_buckets} batch sizes, "
                   f"{e.graph_bytes / 2**20:.0f} MiB" if e.graph_buckets else ""))


def load_items(cfg: RunConfig) -> list[ImageItem]:
    """Every input item, validated (a table's or shard's items are references: their images
    are read when prepared)."""
    policy = read_policy(cfg.policy) if cfg.policy else ()
    limits = prompt_limits(cfg, policy)  # each question's length, before any work
    if cfg.manifest is not None:
        return read_manifest(cfg.manifest, policy, limits)
    if cfg.dataset is not None:
        items: list[ImageItem] = []
        seen: dict[str, str] = {}
        for where, it in checked(iter_dataset(cfg.dataset, cfg.image_column, cfg.id_column,
                                              cfg.questions_column, policy, cfg.prepare.fetch),
                                 limits):
            if (first := seen.setdefault(it.id, where)) != where:
                raise ManifestError(f"{where}: id {it.id!r} appears twice (first at {first})")
            items.append(it)
        return items
    assert cfg.images is not None
    return items_from_folder(cfg.images, policy)


def run(cfg: RunConfig, out: IO[str] | None = None, hooks: FaultHooks = NO_HOOKS,
        items: list[ImageItem] | None = None) -> RunSummary:
    """Run a whole manifest (or ``items``, read from it already) in this process. Raises
    ManifestError/ModelError before any work."""
    items = load_items(cfg) if items is None else items
    openai = cfg.manifest is not None and manifest_format(cfg.manifest) == "openai"
    fmt = format_of(cfg.out)
    check_label_sets(cfg.model.path, cfg.engine, label_sets(items))
    hooks.loading()
    engine = build_engine(cfg.model, cfg.engine, cfg.threads)
    n_q = sum(len(it.questions) for it in items)
    sink = GroupWriter(cfg.out, fmt, openai, out, has_clips(items))
    failed_images = failed_q = 0
    start = time.perf_counter()
    bar = tqdm(total=n_q, unit="q", disable=not cfg.progress, file=sys.stderr,
               desc="answering", dynamic_ncols=True)
    loop = drive(AnswerTask(), engine, groups_of(items, cfg.images_per_batch),
                 cfg.prepare_options, sink, hooks=hooks)
    try:
        for _, results in loop:
            failed = [r for r in results if r and r[0].error]
            failed_images += len(failed)
            failed_q += sum(len(r) for r in failed)
            bar.update(sum(len(r) for r in results))
            minutes = (time.perf_counter() - start) / 60
            bar.set_postfix(qpm=f"{(bar.n - failed_q) / max(minutes, 1e-9):.0f}",
                            errors=failed_images)
    finally:
        bar.close()
        sink.close()
    return RunSummary(len(items), n_q, failed_images, failed_q, time.perf_counter() - start,
                      engine.summary())

