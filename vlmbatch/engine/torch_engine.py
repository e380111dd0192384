"""Our torch engine: encode each image once, prefill many prompts in batches over an
image-aware prefix KV cache, and read what the call asks for: P(yes) at the first generated
position (``score``) or pooled hidden states (``embed``).

An item is one still image, or a ``MediaItem`` (several images, a clip: ``records.py``):
its prompt is the family's ``build_parts``, its embeddings cover its whole span
(``features.py``: a clip's frame groups encoded once by content), and the prefix cache keys
each of its parts (``planner.key_spans``); the flow below is the same for both.

Flow of one ``score`` call::

    Request[] --prompts--> Prompt[]     the family's chat template (a system turn, when
                                        given, before the image), image span expanded
    planner.shared_lengths              each prompt's shared prefix (through the image, and
                                        what the image's other prompts also start with)
    rows (``question_rows``: on CUDA)   the yes/no questions: ``packing.make_rows`` (one row
                                        per image: its prefix, then its questions), the
                                        images they need encoded, ``packing.steps`` (rows
                                        per token budget), one ``runner.prefill_rows`` each
    planner.phases                      the rest (label sets, text, what a row cannot hold,
                                        a hybrid decoder's; every question without rows):
                                        leaders (first question per prefix), then followers
    per phase (``_phase``, shared with ``embed``):
      planner.plan      longest cached prefix per prompt -> pinned slots + past_len
      runner.encode     images whose tokens are not all cached -> ImageEmbeds, once per
                        image per call
      planner.batches   sorted by new length, B * (P_max + T_max) <= max_batch_tokens
      forward           one per batch: runner.prefill -> [B, 2] (p_yes, margin) on the
                        device, label sets' log-likelihoods (``engine/choices.py``), new
                        prefix blocks cached, greedy text for rows that want it
                        (``embed``: runner.hidden -> the embedding head's vectors)
      planner.release   once the batch has gathered its cached KV
    read back           one device-to-host copy per call -> Score[]

``embed`` runs one phase whose plans reuse cached KV only before each prompt's first pooled
position (``engine/embed.py``). The planner (``planner.py``) is pure Python; the runner
(``model_runner.py``) holds every tensor; nothing outside this class reaches either.
Counters (``EngineStats``) make the savings visible and testable: tiles encoded, tokens
prefilled, image tokens prefilled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from vlmbatch.engine import packing
from vlmbatch.engine.base import Engine, EngineStats, EngineSummary
from vlmbatch.engine.config import ConfigError, EmbedConfig, EngineConfig, ModelConfig, Resolved
from vlmbatch.engine.embed import EmbedHead, cut
from vlmbatch.engine.loading import (
    image_plan_for,
    load_model,
    torch_dtype,
    video_plan_for,
    vision_model,
)
from vlmbatch.engine.model_runner import Generated, ImageEmbeds, ModelRunner, StepInputs
from vlmbatch.engine.packing import Row
from vlmbatch.engine.planner import Plan, Planner, Prefix
from vlmbatch.engine.prefix_cache import BlockId, PrefixCache
from vlmbatch.engine.records import EmbedRequest, Item, MediaItem, Request, Score, Vector
from vlmbatch.engine.scoring import AnswerTokens, ChoiceIds, choice_ids
from vlmbatch.models.base import LoadedModel, Prompt
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage
from vlmbatch.vit_trt.base import RunnerOptions, VitRunner, make_runner
from vlmbatch.vit_trt.torch_runner import TorchRunner

Out = TypeVar("Out")
# a batch's forward: (its plans, each row's image embeddings or None) -> what it gives
Forward = Callable[[list[Plan], list[ImageEmbeds | None]], Out]
# per queued batch: its plans, [B, 2] (p_yes, margin) on the device, its generated (text,
# tokens), its label sets' log-likelihoods [M] on the device (None: no label set)
_Queued = list[tuple[list[Plan], tuple[torch.Tensor, list[Generated | None],
                                       torch.Tensor | None]]]
# per step of rows (``engine/packing.py``): its requests, [Q, 2] (p_yes, margin) on the device
_Rows = list[tuple[list[int], torch.Tensor]]


class TorchEngine(Engine):
    def __init__(self, model: LoadedModel, cfg: EngineConfig, vision: VitRunner | None = None,
                 image_plan: ImagePlan | None = None) -> None:
        self.model = model  # as loaded: fused by ``build_torch_engine`` (``load_model(fuse=True)``)
        self.cfg = cfg
        # the run's plan; by default the checkpoint's under a default ModelConfig
        self.image_plan = image_plan or image_plan_for(model.family, model.spec, ModelConfig())
        self.video_plan = video_plan_for(model.spec, getattr(self.image_plan, "resize", "opencv"))
        self.vision = vision or TorchRunner(vision_model(model))
        self.answers = AnswerTokens.from_words(model.tokenizer, cfg.yes_words, cfg.no_words)
        self.cache = PrefixCache(cfg.block_size, cfg.cache_bytes) if cfg.prefix_cache else None
        self.stats = EngineStats()
        self.runner = ModelRunner(model, self.vision, self.cache, self.answers, self.stats,
                                  cfg.max_batch_tiles, cfg.ignore_eos, cfg.compile_llm)
        codec = self.runner.codec  # a hybrid decoder's state snapshots (None: none)
        self.planner = Planner(self.cache, cfg.max_batch_tokens,
                               0 if codec is None else codec.nbytes)
        self.device = self.runner.device
        self._heads: dict[EmbedConfig, EmbedHead] = {}
        self._choice_ids: dict[tuple[str, ...], ChoiceIds] = {}
        self._first_token = cfg.choice_scoring == "first-token"
        self._dynamic = getattr(model.spec.text, "rope_scaling", "none") == "dynamic"
        rows = cfg.question_rows
        self._question_rows = rows == "on" or (rows == "auto" and self.device.type == "cuda")
        # step k + 1's host inputs made on a thread during step k (``_prepare``): off, it
        # does not pay (docs/engine.md, "Host cost": 0.3-0.8 ms of host work per step)
        self.prepare_ahead = False
        self._ahead: ThreadPoolExecutor | None = None
        if self.cache is not None:
            self._allocate_cache()

    def _allocate_cache(self) -> None:
        """The prefix cache's KV pool, now: a --cache-mib that cannot be had fails here,
        with what to do, rather than in every batch."""
        assert self.cache is not None
        s = self.model.spec.text
        layers = len(self.runner.full)  # a hybrid decoder's linear layers keep no K/V
        try:
            self.cache.allocate((layers, 2, s.kv_heads, s.head_dim),
                                self.model.llm.embed_tokens.weight.dtype, self.device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--cache-mib {self.cfg.cache_bytes >> 20}: the prefix cache's "
                              f"KV pool does not fit on {self.device} ({why}); give a smaller "
                              "--cache-mib, or --no-prefix-cache") from None

    def summary(self) -> EngineSummary:
        pool = self.vision.pool
        return EngineSummary(
            self.stats.prefill_tokens, self.stats.prompt_tokens,
            self.cache.stats.hit_rate() if self.cache is not None else None,
            len(pool.graphs) if pool is not None else 0,
            pool.graph_bytes if pool is not None else 0)

    @torch.inference_mode()
    def encode(self, images: list[PreparedImage]) -> list[ImageEmbeds]:
        return self.runner.encode(images)

    def check_choices(self, choices: tuple[str, ...]) -> None:
        self.choice_ids(choices)

    def choice_ids(self, choices: tuple[str, ...]) -> ChoiceIds:
        """The label set's token ids (as the assistant's answer), checked for this engine's
        scoring (``scoring.choice_ids``: ChoiceError naming two choices it cannot tell
        apart); made once per label set."""
        ids = self._choice_ids.get(choices)
        if ids is None:
            ids = choice_ids(self.model.prompts.answer_ids, choices, self._first_token)
            self._choice_ids[choices] = ids
        return ids

    @torch.inference_mode()
    def score(self, images: list[Item], requests: list[Request]) -> list[Score]:
        choices = [self.choice_ids(r.choices) if r.choices else () for r in requests]
        prompts = [self._prompt(r, images[r.image]) for r in requests]
        self.stats.prompt_tokens += sum([len(p.ids) for p in prompts])  # what was asked
        image_of: list[int | None] = [r.image for r in requests]
        embeds: dict[int, ImageEmbeds] = {}
        prefixes: dict[Prefix, list[BlockId]] = {}
        shared = self.planner.shared_lengths(requests, prompts)

        def forward(batch: list[Plan], ims: list[ImageEmbeds | None]
                    ) -> tuple[torch.Tensor, list[Generated | None], torch.Tensor | None]:
            return self.runner.prefill(batch, ims, [self._limit(requests[p.req]) for p in batch],
                                       [choices[p.req] for p in batch], self._first_token)

        done: _Queued = []
        rows: _Rows = []
        phases = self.planner.phases(requests, prompts, shared)
        # yes/no questions in rows, the rest after them in phases; a hybrid decoder's linear
        # layers keep one state per row: its questions stay on the phases
        if self.cache is not None and self._question_rows and not self.planner.state_bytes:
            rows, rest = self._rows(images, requests, prompts, shared, embeds, prefixes)
            keep = set(rest)
            phases = [kept for ph in phases if (kept := [i for i in ph if i in keep])]
        for phase in phases:
            done += self._phase(phase, prompts, image_of, images, embeds, prefixes, forward,
                                shared=shared)
        return self._read_back(rows, done, len(requests), choices, prompts)

    def context_error(self, item: Item, request: Request) -> str | None:
        context = int(getattr(self.model.spec.text, "max_positions", 0) or 0)
        if context <= 0:
            return None
        prompt = self._prompt(request, item)
        if (n := len(prompt.ids)) < context:  # room for the first answer token
            return None
        return (f"the prompt of question {request.question[:40]!r} is {n:,} tokens, its "
                f"images' and frames' included, over the model's context of {context:,} "
                "(config.json max_position_embeddings): set --max-video-tokens (or the line's "
                "max_video_tokens), sample fewer frames, or give fewer images")

    def _prompt(self, r: Request, item: Item) -> Prompt:
        """``r``'s prompt: about one image (``build``), or an item's parts (``build_parts``)."""
        if isinstance(item, MediaItem):
            return self.model.prompts.build_parts(r.question, item.parts, r.system)
        return self.model.prompts.build(r.question, item, r.system)

    def _rows(self, images: list[Item], requests: list[Request],
              prompts: list[Prompt], shared: list[int], embeds: dict[int, ImageEmbeds],
              prefixes: dict[Prefix, list[BlockId]]) -> tuple[_Rows, list[int]]:
        """The questions that want only P(yes) in rows (``engine/packing.py``: an image's
        prefix and its questions in one row, a step of rows per token budget): each step's
        requests and ``[Q, 2]`` (p_yes, margin) on the device; and the requests left for
        the phases (label sets, text, what a row cannot hold)."""
        text = self.cfg.max_new_tokens  # the engine's limit, where a request sets none
        packable = [not r.choices and not (text if r.max_new_tokens is None
                                           else r.max_new_tokens) for r in requests]
        if self._dynamic:
            packable = [ok and self._rope_fits(p) for ok, p in zip(packable, prompts)]
        rows, rest = packing.make_rows(self.planner, requests, prompts, images, shared,
                                       prefixes, packable)
        out: _Rows = []
        try:
            need = sorted({k for r in rows if r.plan.needs_image
                           and (k := requests[r.plan.req].image) not in embeds})
            embeds.update(zip(need, self.runner.encode([images[k] for k in need])))
            steps = packing.steps(rows, self.cfg.max_batch_tokens)
            ahead = self._prepare(steps, prompts)  # step k + 1's host work during step k
            for step in steps:
                ims = [embeds.get(requests[r.plan.req].image) for r in step]
                out.append(([i for r in step for i in r.members],
                            self.runner.prefill_rows(step, ims, next(ahead))))
                self.planner.release([r.plan for r in step])  # gathered: see ``_phase``
        finally:
            self.planner.release([r.plan for r in rows])
        return out, rest

    def _prepare(self, steps: list[list[Row]], prompts: list[Prompt]
                 ) -> Iterator[StepInputs]:
        """Each step's host inputs (``ModelRunner.step_inputs``), in order; with
        ``prepare_ahead`` the next step's are made on a thread while the caller runs this
        one (torch releases the GIL inside its ops), else each when asked."""
        if not self.prepare_ahead or len(steps) < 2:
            return (self.runner.step_inputs(s, prompts) for s in steps)
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="vlmbatch-step")
        pool = self._ahead

        def chain() -> Iterator[StepInputs]:
            nxt = pool.submit(self.runner.step_inputs, steps[0], prompts)
            for k in range(len(steps)):
                cur = nxt.result()
                if k + 1 < len(steps):
                    nxt = pool.submit(self.runner.step_inputs, steps[k + 1], prompts)
                yield cur
        return chain()

    def _rope_fits(self, p: Prompt) -> bool:
        """Whether ``p`` may share a row: not past a dynamic rotary's trained length
        (``packing`` module docstring)."""
        s = self.model.spec.text
        return (getattr(s, "rope_scaling", "none") != "dynamic"
                or len(p.ids) <= getattr(s, "max_positions", 0))

    def embedding(self, cfg: EmbedConfig) -> Resolved:
        return self._head(cfg).resolved

    @torch.inference_mode()
    def embed(self, images: list[PreparedImage], requests: list[EmbedRequest],
              cfg: EmbedConfig) -> list[Vector]:
        head = self._head(cfg)
        prompts = [head.prompt(r, images) for r in requests]
        ranges = [head.range(p) for p in prompts]
        self.stats.prompt_tokens += sum(g.end for g in ranges)

        def forward(batch: list[Plan], ims: list[ImageEmbeds | None]) -> list[np.ndarray]:
            return head.vectors(self.runner.hidden(batch, ims), batch, ranges,
                                self.runner.to_device)

        values: list[np.ndarray | None] = [None] * len(requests)
        for batch, vecs in self._phase(range(len(requests)),
                                       [cut(p, g.end) for p, g in zip(prompts, ranges)],
                                       [r.image for r in requests], images, {}, {}, forward,
                                       reuse=[g.start for g in ranges]):
            for p, v in zip(batch, vecs):
                values[p.req] = v
        return [Vector(v, len(p.ids)) for v, p in zip(values, prompts)]  # type: ignore[arg-type]

    def embed_prompt(self, request: EmbedRequest, images: list[PreparedImage],
                     cfg: EmbedConfig) -> Prompt:
        return self._head(cfg).prompt(request, images)

    def _head(self, cfg: EmbedConfig) -> EmbedHead:
        if cfg not in self._heads:  # resolved (and its projection loaded) once per config
            self._heads[cfg] = EmbedHead(self.model, cfg, self.device)
        return self._heads[cfg]

    def _phase(self, phase: Sequence[int], prompts: list[Prompt], image_of: list[int | None],
               images: Sequence[Item], embeds: dict[int, ImageEmbeds],
               prefixes: dict[Prefix, list[BlockId]], forward: Forward[Out],
               reuse: list[int] | None = None, shared: list[int] | None = None
               ) -> list[tuple[list[Plan], Out]]:
        """Plan the prompts ``phase`` indexes (each lookup pins cache slots; ``reuse``: the
        position before which each may reuse cached KV; ``shared``: each one's shared prefix
        length, by default through its image), encode the images they need (once per call:
        ``embeds``), run ``forward`` on each batch and unpin its slots once it has gathered
        them; what an exception left pinned is released too."""
        plans: list[Plan] = []
        try:
            for i in phase:
                k = image_of[i]
                plans.append(self.planner.plan(i, prompts[i], None if k is None else images[k],
                                               prefixes, None if reuse is None else reuse[i],
                                               None if shared is None else shared[i]))
            need = sorted({k for p in plans if p.needs_image and (k := image_of[p.req])
                           is not None} - embeds.keys())
            embeds.update(zip(need, self.runner.encode([images[k] for k in need])))
            out = []
            for batch in self.planner.batches(plans):
                ims = [None if (k := image_of[p.req]) is None else embeds.get(k) for p in batch]
                out.append((batch, forward(batch, ims)))
                # its cached KV was gathered into the batch's past: a later insert into the
                # same slots is queued after that gather on the same stream
                self.planner.release(batch)
            return out
        finally:
            self.planner.release(plans)

    def _limit(self, r: Request) -> int:
        """Answer tokens to generate for ``r``: its own limit, else the engine's."""
        return self.cfg.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens

    def _read_back(self, rows: _Rows, done: _Queued, n: int, choices: list[ChoiceIds],
                   prompts: list[Prompt]) -> list[Score]:
        """The rows' and the queued batches' (p_yes, margin) and label sets'
        log-likelihoods in one device-to-host copy, as Scores in request order."""
        results: list[Score | None] = [None] * n
        if not done and not rows:
            return results  # type: ignore[return-value]
        # each step's [Q, 2], then per batch its [B, 2] flattened and its [M]: the one wait
        host = iter(torch.cat([s.flatten() for _, s in rows]
                              + [t for _, (s, _, lp) in done for t in (s.flatten(), lp)
                                 if t is not None]).tolist())
        for members, _ in rows:
            for i in members:
                prompt = prompts[i]
                results[i] = Score(next(host), next(host), prompt.image_len, None,
                                   len(prompt.ids))
        for batch, (_, texts, lp) in done:
            pairs = [(next(host), next(host)) for _ in batch]
            for j, (p, (p_yes, margin)) in enumerate(zip(batch, pairs)):
                text = texts[j]
                results[p.req] = Score(p_yes, margin, p.prompt.image_len,
                                       None if text is None else text[0], len(p.prompt.ids),
                                       completion_tokens=None if text is None else text[1])
            if lp is not None:
                for p in batch:
                    s = results[p.req]
                    if choices[p.req] and s is not None:
                        lps = tuple(next(host) for _ in choices[p.req])
                        results[p.req] = dataclasses.replace(s, logprobs=lps)
        return results  # type: ignore[return-value]


def build_torch_engine(model_cfg: ModelConfig, engine_cfg: EngineConfig,
                threads: int | None = None, fuse: bool = True) -> TorchEngine:
    """Our engine on ``model_cfg``'s checkpoint and device, on ``threads`` torch threads;
    its projections fused at load (``load_model``'s ``fuse``; off for calibration, which
    reads the linears by name)."""
    if threads:
        torch.set_num_threads(threads)
    model = load_configured(model_cfg, fuse)
    return TorchEngine(model, engine_cfg, vision_runner(model, model_cfg, engine_cfg),
                       image_plan_for(model.family, model.spec, model_cfg))


def load_configured(model_cfg: ModelConfig, fuse: bool = True) -> LoadedModel:
    """``model_cfg``'s checkpoint on its device, in its dtype (``--dtype auto`` resolved)."""
    return load_model(model_cfg.path, model_cfg.device, torch_dtype(model_cfg.resolved_dtype),
                      model_cfg.llm_quant, model_cfg.quant, fuse)


def vision_runner(model: LoadedModel, model_cfg: ModelConfig, engine_cfg: EngineConfig
                  ) -> VitRunner:
    """The vision encoder's runner as ``engine_cfg`` asks (one per engine, or shared by the
    engines of a benchmark row)."""
    # stream-ordered: the engine reads the embeddings on the stream that made them, so the graph
    # pool's host wait per call would only stall the host (16% of a profiled round at
    # InternVL3-1B's shape on an H200, docs/gpu.md)
    return make_runner(engine_cfg.vit_backend, vision_model(model), RunnerOptions(
        model_cfg.device, engine_cfg.cuda_graphs, engine_cfg.vit_max_batch,
        stream_ordered=True))
