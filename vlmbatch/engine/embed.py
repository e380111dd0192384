"""Embeddings: an ``EmbedConfig`` resolved against a checkpoint (``Resolved``), and the
embedding head the torch engine runs (``EmbedHead``: prompts, pooled positions, pooling,
projection). The engine owns the work (``TorchEngine.embed``: planning over the image-aware
prefix cache, encoding, one forward per batch through its one phase runner, shared with
scoring); ``EmbedHandle`` is what callers hold: an engine and a config.

Flow of one ``TorchEngine.embed`` call::

    EmbedHead.prompt       the family's embed prompt (the chat template's user turn)
    pooling.pool_range     positions each vector reads; the prompt is cut after the last
                           (causal: later tokens cannot change it)
    planner.plan           cached KV only for blocks ending before the first pooled position
                           (hidden states are needed from there on, the cache holds KV); the
                           rest of the image's prefix is computed and cached, so a question
                           asked of the image later finds it
    runner.encode          images whose tokens are not all cached, once per image per call
    runner.hidden          one forward per batch -> last hidden states [B, T, D]
    EmbedHead.vectors      mean over each row's range (or every row of it, projected, for a
                           multi-vector), Matryoshka truncation, L2; on the device, then one
                           device-to-host copy per batch

So an image asked a question first and embedded with ``last`` pooling (or asked after being
embedded, whatever the pooling) is not encoded nor its image tokens prefilled twice
(``EngineStats``; tests/engine/test_embed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from vlmbatch.engine.config import ConfigError, EmbedConfig, Resolved, resolve
from vlmbatch.engine.loading import read_spec
from vlmbatch.engine.planner import Plan
from vlmbatch.engine.pooling import PoolRange, mean_rows, pool_range, unit
from vlmbatch.engine.records import EmbedRequest, Vector
from vlmbatch.models.base import LoadedModel, Prompt
from vlmbatch.models.config_io import read_config
from vlmbatch.models.embedding import read_embedding_spec, read_projection
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage

if TYPE_CHECKING:
    from vlmbatch.engine.base import Engine


def check_embed_config(path: Path | None, cfg: EmbedConfig) -> Resolved:
    """``cfg`` resolved on the checkpoint at ``path`` (None: ``load_model``'s default),
    weights not read: what ``submit --task embed`` checks before any work."""
    family, spec = read_spec(path)
    declared = read_embedding_spec(spec.path, read_config(spec.path), family.default_pooling,
                                   family.multi_vector_default)
    return resolve(cfg, declared, family.image_prompt, spec.text.hidden)


def embedding_checkpoint(path: Path | None) -> bool:
    """Whether the checkpoint at ``path`` declares itself an embedding model (a pooling,
    Matryoshka sizes or a projection layer; ``models/embedding.py``)."""
    family, spec = read_spec(path)
    return read_embedding_spec(spec.path, read_config(spec.path),
                               family.default_pooling).declared


class EmbedHead:
    """What turns a loaded model's prompts and hidden states into vectors for one
    ``EmbedConfig`` (the engine keeps one per config it is asked for)."""

    def __init__(self, model: LoadedModel, cfg: EmbedConfig, device: torch.device) -> None:
        if not model.family.embeddings:
            raise ConfigError(f"{model.spec.model_type} checkpoints cannot give embeddings "
                              "(docs/embeddings.md, 'Not done')")
        self.model, self.cfg = model, cfg
        spec = read_embedding_spec(model.spec.path, read_config(model.spec.path),
                                   model.family.default_pooling,
                                   model.family.multi_vector_default)
        self.resolved = resolve(cfg, spec, model.family.image_prompt, model.spec.text.hidden)
        self.projection: torch.nn.Linear | None = None
        if self.resolved.multi_vector and spec.projection is not None:
            self.projection = _linear(*read_projection(model.spec.path, spec.projection),
                                      device, model.llm.embed_tokens.weight.dtype)

    def prompt(self, r: EmbedRequest, images: list[PreparedImage]) -> Prompt:
        """The request's prompt, prefixes and image prompt applied (``EmbedConfig``)."""
        if r.image is None:
            return self.model.prompts.embed(self.cfg.query_prefix + (r.text or ""), None)
        text = (self.cfg.document_prefix + r.text if r.text is not None
                else self.resolved.image_prompt)
        return self.model.prompts.embed(text, images[r.image])

    def range(self, p: Prompt) -> PoolRange:
        return pool_range(p, self.resolved.pooling, self.resolved.multi_vector)

    def vectors(self, hidden: torch.Tensor, batch: list[Plan], ranges: list[PoolRange],
                to_device: Callable[[list], torch.Tensor]) -> list[np.ndarray]:
        """Each row's vector (``[D]``) or token vectors (``[T_j, D]``), float32 on the host,
        from the batch's last hidden states ``[B, T, D]`` (row j's new position t is prompt
        position ``past_len + t``)."""
        starts = [ranges[p.req].start - p.past_len for p in batch]
        ends = [ranges[p.req].end - p.past_len for p in batch]
        if not self.resolved.multi_vector:
            pooled = mean_rows(hidden, to_device(starts), to_device(ends))
            return list(unit(pooled, self.resolved.dimensions).cpu().numpy())
        rows = [hidden[j, s:e] for j, (s, e) in enumerate(zip(starts, ends))]
        if self.projection is not None:
            rows = [self.projection(x) for x in rows]
        return [unit(x.float()).cpu().numpy() for x in rows]


def cut(p: Prompt, end: int) -> Prompt:
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


class EmbedHandle:
    """An engine and an ``EmbedConfig``: ``embed`` asks the engine for vectors."""

    def __init__(self, engine: Engine, cfg: EmbedConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.resolved = engine.embedding(cfg)  # ConfigError if it cannot

    @property
    def image_plan(self) -> ImagePlan:
        """How inputs' images are prepared (the engine's plan)."""
        return self.engine.image_plan

    def embed(self, images: list[PreparedImage], requests: list[EmbedRequest]) -> list[Vector]:
        """One vector per request, in order; ``EmbedRequest.image`` indexes ``images``."""
        return self.engine.embed(images, requests, self.cfg)

    def prompt(self, request: EmbedRequest, images: list[PreparedImage]) -> Prompt:
        """The prompt ``embed`` builds for ``request``."""
        return self.engine.embed_prompt(request, images, self.cfg)


def build_embedder(engine: Engine, cfg: EmbedConfig) -> EmbedHandle:
    """An embedder on ``engine``; ConfigError for an engine or checkpoint that cannot embed,
    or options the checkpoint cannot meet."""
    return EmbedHandle(engine, cfg)
