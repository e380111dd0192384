"""The timed rows of ``vlmbatch bench`` (and of ``bench/qpm.py``, which builds its vlmbatch
rows from ``EngineRow``): each row warmed up once, untimed, at construction; ``timed_rounds``
then times the rows round for round, the order rotated each round, so that a slow spell of
a shared machine lands on every row rather than on one; each row keeps its best round.

A vlmbatch round answers every item with a fresh engine (empty prefix cache, zeroed
counters) on the row's loaded model and vision runner (shared by its rounds: graph capture
and kernel choice happen in the warm-up). Memory: the process's peak RSS after the row's
set-up and warm-up (a peak: it includes the rows set up before it), and on CUDA the peak
GPU memory allocated during the row's rounds.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vlmbatch.cli.bench.baseline import Batched, load_reference
from vlmbatch.cli.bench.baseline_qwen import QwenBatched, load_qwen_reference
from vlmbatch.cli.bench.config import Variant
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.engine.loading import image_plan_for, torch_dtype
from vlmbatch.engine.scoring import AnswerTokens
from vlmbatch.engine.torch_engine import TorchEngine, load_configured, vision_runner
from vlmbatch.models.base import LoadedModel
from vlmbatch.pipeline.drive import answer_group
from vlmbatch.pipeline.records import ImageItem


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RoundRunner(Protocol):
    name: str
    times: list[float]

    def round(self) -> None: ...


def timed_rounds(rows: list[Any], rounds: int) -> None:
    """``rounds`` rounds of every row, interleaved, the order rotated each round."""
    for r in range(rounds):
        k = r % len(rows)
        for row in rows[k:] + rows[:k]:
            row.round()


class Models:
    """Loaded models by what loads them (path, device, resolved dtype, quantisation): rows
    that differ only in engine options share one."""

    def __init__(self) -> None:
        self._loaded: dict[tuple, LoadedModel] = {}

    def get(self, cfg: ModelConfig) -> LoadedModel:
        key = (cfg.model_dir, cfg.device, cfg.resolved_dtype, cfg.llm_quant, cfg.quant)
        if key not in self._loaded:
            self._loaded[key] = load_configured(cfg)  # fused, as `run` loads it
        return self._loaded[key]


class EngineRow:
    """One vlmbatch row: ``model_cfg``'s model (``model``: already loaded) run as
    ``engine_cfg`` asks on ``items`` in groups of ``images_per_batch``; warmed up at
    construction on ``warm`` (untimed). ``round()`` times one round with a fresh engine and
    keeps its P(yes), its engine (counters, cache) and the GPU memory it peaked at."""

    def __init__(self, name: str, model: LoadedModel, model_cfg: ModelConfig,
                 engine_cfg: EngineConfig, items: list[ImageItem], images_per_batch: int,
                 warm: list[ImageItem]) -> None:
        self.name, self.model, self.cfg, self.items = name, model, engine_cfg, items
        self.images_per_batch = images_per_batch
        self.dtype = model_cfg.resolved_dtype
        self.runner = vision_runner(model, model_cfg, engine_cfg)
        self.plan = image_plan_for(model.family, model.spec, model_cfg)
        self.times: list[float] = []
        self.p_yes: list[float | None] = []
        self.gpu_mib: float | None = None
        self.answer(self.engine(), warm[:images_per_batch])
        self.rss = peak_rss_mib()

    def engine(self) -> TorchEngine:
        return TorchEngine(self.model, self.cfg, self.runner, self.plan)

    def answer(self, engine: TorchEngine, items: list[ImageItem]) -> list[float | None]:
        """P(yes) of every question (None for a label set's)."""
        out: list[float | None] = []
        for g in range(0, len(items), self.images_per_batch):
            out += [a.p_yes for a in answer_group(engine, items[g: g + self.images_per_batch])]
        return out

    def round(self) -> None:
        engine = self.engine()
        cuda = self.runner_device().type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        self.p_yes = self.answer(engine, self.items)
        if cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        self.last_engine = engine
        if cuda:
            peak = torch.cuda.max_memory_allocated() / 2**20
            self.gpu_mib = max(self.gpu_mib or 0.0, peak)

    def runner_device(self) -> torch.device:
        return self.model.llm.embed_tokens.weight.device


@dataclass
class BaselineRow:
    """The batched transformers row (``baseline.py``/``baseline_qwen.py``), timed as the
    others; its reference model loaded in the bench's device and dtype."""
    name: str
    inner: Any  # a Batched or QwenBatched
    dtype: str
    rss: float

    @property
    def times(self) -> list[float]:
        return self.inner.times

    @property
    def p_yes(self) -> list[float]:
        return self.inner.p_yes

    def round(self) -> None:
        self.inner.round()


def baseline_row(host: LoadedModel, model_cfg: ModelConfig, items: list[ImageItem],
                 warm: list[ImageItem], batch: int = 16) -> BaselineRow:
    """The batched transformers baseline on ``model_cfg``'s checkpoint, device and dtype,
    warmed up on ``warm``."""
    spec, tok, prompts = host.spec, host.tokenizer, host.prompts
    e = EngineConfig()
    answers = AnswerTokens.from_words(tok, e.yes_words, e.no_words)
    dtype = torch_dtype(model_cfg.resolved_dtype)
    pad = tok.pad_token_id or 0
    if host.family.packed_vision:  # Qwen-VL
        ref = load_qwen_reference(model_cfg.model_dir, model_cfg.device, dtype)
        inner: Any = QwenBatched(ref, spec, prompts, answers, items, warm, batch, pad)
    else:
        ref = load_reference(model_cfg.model_dir, model_cfg.device, dtype)
        inner = Batched(ref, spec, prompts, answers, items, warm, batch, True, pad)
    return BaselineRow("transformers, batched", inner, model_cfg.resolved_dtype, peak_rss_mib())


def engine_rows(variants: list[Variant], items: list[ImageItem], warm: list[ImageItem],
                models: Models) -> list[EngineRow]:
    """One warmed-up row per variant."""
    return [EngineRow(v.name, models.get(v.model), v.model, v.engine, items,
                      v.images_per_batch, warm) for v in variants]
