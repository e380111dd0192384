"""Embeddings on our torch engine: inputs (image, text or both) -> unit vectors, batched like
the engine's prefills and over the same image-aware prefix cache.

Flow of one ``Embedder.embed`` call::

    EmbedRequest[] --family.embed prompts--> Prompt[]     the chat template's user turn
    pooling.pool_range      positions each vector reads; the prompt is cut after the last
                            (causal: later tokens cannot change it)
    planner.plan            cached KV only for blocks ending before the first pooled position
                            (hidden states are needed from there on, the cache holds KV); the
                            rest of the image's prefix is computed and cached, so a question
                            asked of the image later finds it
    runner.encode           images whose tokens are not all cached, once per image per call
    planner.batches         sorted by new length, B * (P_max + T_max) <= max_batch_tokens
    runner.hidden           one forward per batch -> last hidden states [B, T, D]
    pooling                 mean over each row's range (or every row of it, projected, for a
                            multi-vector), Matryoshka truncation, L2; on the device
    read back               one device-to-host copy per batch -> Vector[]

So an image asked a question first and embedded with ``last`` pooling (or asked after being
embedded, whatever the pooling) is not encoded nor its image tokens prefilled twice
(``EngineStats``; tests/pipeline/test_embed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlmbatch.models.base import Prompt
from vlmbatch.models.embedding import EmbeddingSpec, read_embedding_spec, read_projection
from vlmbatch.models.io import read_config
from vlmbatch.pipeline.config import ConfigError, EmbedConfig
from vlmbatch.pipeline.engine import Engine
from vlmbatch.pipeline.loading import read_spec
from vlmbatch.pipeline.model_runner import ImageEmbeds
from vlmbatch.pipeline.planner import Plan
from vlmbatch.pipeline.pooling import PoolRange, mean_rows, pool_range, unit
from vlmbatch.pipeline.prefix_cache import BlockId, ImageSpan
from vlmbatch.pipeline.records import EmbedRequest, Vector
from vlmbatch.pipeline.torch_engine import TorchEngine
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage


@dataclass(frozen=True)
class Resolved:
    """An ``EmbedConfig`` checked against the checkpoint: what the embedder does."""
    pooling: str
    dimensions: int | None
    multi_vector: bool
    image_prompt: str
    spec: EmbeddingSpec


def resolve(cfg: EmbedConfig, spec: EmbeddingSpec, image_prompt: str) -> Resolved:
    """``cfg`` on a checkpoint declaring ``spec``; ConfigError for a Matryoshka size it does
    not declare (unless forced)."""
    if cfg.dimensions is not None and cfg.dimensions not in spec.matryoshka_dims \
            and not cfg.force_dimensions:
        have = (f"declares the sizes {list(spec.matryoshka_dims)}" if spec.matryoshka_dims
                else "declares no Matryoshka sizes (config.json matryoshka_dims)")
        raise ConfigError(f"--dimensions {cfg.dimensions}: this checkpoint {have}, so its "
                          "first components alone were not trained to work as an embedding; "
                          "--force-dimensions truncates anyway")
    multi = cfg.multi_vector if cfg.multi_vector is not None else (
        spec.multi_vector and cfg.pooling is None and cfg.dimensions is None)
    return Resolved(cfg.pooling or spec.pooling, cfg.dimensions, multi,
                    cfg.prompt or image_prompt, spec)


def check_embed_config(path: Path | None, cfg: EmbedConfig) -> Resolved:
    """``cfg`` resolved on the checkpoint at ``path`` (None: ``load_model``'s default),
    weights not read: what ``submit --task embed`` checks before any work."""
    family, spec = read_spec(path)
    declared = read_embedding_spec(spec.path, read_config(spec.path), family.default_pooling,
                                   family.multi_vector_default)
    return resolve(cfg, declared, family.image_prompt)


def embedding_checkpoint(path: Path | None) -> bool:
    """Whether the checkpoint at ``path`` declares itself an embedding model (a pooling,
    Matryoshka sizes or a projection layer; ``models/embedding.py``)."""
    family, spec = read_spec(path)
    return read_embedding_spec(spec.path, read_config(spec.path),
                               family.default_pooling).declared


class Embedder:
    """Embeddings from a ``TorchEngine``'s model, vision runner, planner and prefix cache
    (shared with its ``score``: the same KV serves both)."""

    def __init__(self, engine: TorchEngine, cfg: EmbedConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        model = engine.model
        spec = read_embedding_spec(model.spec.path, read_config(model.spec.path),
                                   model.family.default_pooling,
                                   model.family.multi_vector_default)
        self.resolved = resolve(cfg, spec, model.family.image_prompt)
        self.projection: torch.nn.Linear | None = None
        if self.resolved.multi_vector and spec.projection is not None:
            self.projection = _linear(*read_projection(model.spec.path, spec.projection),
                                      engine.device, model.llm.embed_tokens.weight.dtype)

    @property
    def image_plan(self) -> ImagePlan:
        """How inputs' images are prepared (the engine's plan)."""
        return self.engine.image_plan

    def prompt(self, r: EmbedRequest, images: list[PreparedImage]) -> Prompt:
        """The request's prompt, prefixes and image prompt applied (``EmbedConfig``)."""
        if r.image is None:
            return self.engine.model.prompts.embed(self.cfg.query_prefix + (r.text or ""), None)
        text = (self.cfg.document_prefix + r.text if r.text is not None
                else self.resolved.image_prompt)
        return self.engine.model.prompts.embed(text, images[r.image])

    @torch.inference_mode()
    def embed(self, images: list[PreparedImage], requests: list[EmbedRequest]) -> list[Vector]:
        """One vector per request, in order; ``EmbedRequest.image`` indexes ``images``."""
        prompts = [self.prompt(r, images) for r in requests]
        r = self.resolved
        ranges = [pool_range(p, r.pooling, r.multi_vector) for p in prompts]
        self.engine.stats.prompt_tokens += sum(g.end for g in ranges)
        plans: list[Plan] = []
        prefixes: dict[str, list[BlockId]] = {}
        try:
            for i, (req, p, g) in enumerate(zip(requests, prompts, ranges)):
                plans.append(self._plan(i, _cut(p, g.end), req, images, g, prefixes))
            values = self._run(plans, requests, images, ranges)
        finally:
            self.engine.planner.release(plans)  # what an exception left pinned
        return [Vector(v, len(p.ids)) for v, p in zip(values, prompts)]

    def _plan(self, i: int, prompt: Prompt, req: EmbedRequest, images: list[PreparedImage],
              g: PoolRange, prefixes: dict[str, list[BlockId]]) -> Plan:
        """A text alone is never cached; an image's prefix may reuse KV before ``g.start``."""
        if req.image is None:
            return Plan(i, prompt, ImageSpan(0, 0, ""))
        return self.engine.planner.plan(i, prompt, images[req.image], prefixes,
                                        reuse_limit=g.start)

    def _run(self, plans: list[Plan], requests: list[EmbedRequest],
             images: list[PreparedImage], ranges: list[PoolRange]) -> list:
        """Encode what the plans need, run their batches; float32 numpy values per plan."""
        runner = self.engine.runner
        need = sorted({k for p in plans
                       if p.needs_image and (k := requests[p.req].image) is not None})
        embeds = dict(zip(need, runner.encode([images[k] for k in need])))
        values: list = [None] * len(plans)
        for batch in self.engine.planner.batches(plans):
            ims: list[ImageEmbeds | None] = [
                None if (k := requests[p.req].image) is None else embeds.get(k) for p in batch]
            hidden = runner.hidden(batch, ims)  # [B, T, D]
            self.engine.planner.release(batch)  # gathered: their slots may be reused now
            for p, v in zip(batch, self._vectors(hidden, batch, ranges)):
                values[p.req] = v
        return values

    def _vectors(self, hidden: torch.Tensor, batch: list[Plan],
                 ranges: list[PoolRange]) -> list:
        """Each row's vector (``[D]``) or token vectors (``[T_j, D]``), float32 on the host."""
        starts = [ranges[p.req].start - p.past_len for p in batch]
        ends = [ranges[p.req].end - p.past_len for p in batch]
        if not self.resolved.multi_vector:
            runner = self.engine.runner
            pooled = mean_rows(hidden, runner.to_device(starts), runner.to_device(ends))
            return list(unit(pooled, self.resolved.dimensions).cpu().numpy())
        rows = [hidden[j, s:e] for j, (s, e) in enumerate(zip(starts, ends))]
        if self.projection is not None:
            rows = [self.projection(x) for x in rows]
        return [unit(x.float()).cpu().numpy() for x in rows]


def _cut(p: Prompt, end: int) -> Prompt:
    """``p``'s first ``end`` tokens (and their M-RoPE positions): what a vector reads."""
    positions = None if p.positions is None else p.positions[:, :end]
    return Prompt(p.ids[:end], p.image_start, p.image_len, positions, p.rope_delta)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
            dtype: torch.dtype) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.to(device, dtype).eval()


def build_embedder(engine: Engine, cfg: EmbedConfig) -> Embedder:
    """An embedder on ``engine``; ConfigError for an engine that cannot embed."""
    if not isinstance(engine, TorchEngine):
        raise ConfigError(f"embeddings run on the torch engine (--engine torch), not "
                          f"{type(engine).__name__}")
    if not engine.model.family.embeddings:
        raise ConfigError(f"{engine.model.spec.model_type} checkpoints cannot give embeddings "
                          "(docs/embeddings.md, 'Not done')")
    return Embedder(engine, cfg)
