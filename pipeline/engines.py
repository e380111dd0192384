"""Engine registry: one ``score(images, requests) -> list[Score]`` interface, two backends.

``torch`` is ours (``pipeline/engine.py``, CPU and CUDA, every test runs it); ``lmdeploy``
wraps a TurboMind pipeline (``pipeline/lmdeploy_engine.py``, GPU env only, never run here).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from pipeline.config import ConfigError, EngineConfig, ModelConfig
from pipeline.engine import EngineStats, Request, Score, TorchEngine
from pipeline.model import DEFAULT_MODEL, ModelSpec, load_model, load_tokenizer, read_spec
from pipeline.prefix_cache import PrefixCache
from pipeline.scoring import AnswerTokens
from preprocessing.prepare import PreparedImage, TilingConfig
from vit_trt.runners import default_backend, make_runner


class Engine(Protocol):
    stats: EngineStats
    cache: PrefixCache | None

    def score(self, images: list[PreparedImage], requests: list[Request]) -> list[Score]: ...


def tiling_for(spec: ModelSpec, cfg: ModelConfig) -> TilingConfig:
    """The checkpoint's tiling with the run's mode, tile cap and token budget applied.

    A budget of B tiles (``max_image_tokens // tokens_per_tile``) caps the grid so that grid
    plus thumbnail fit: reference mode adds a thumbnail from 2 grid tiles, reduced from 3.
    """
    t = spec.tiling
    max_tiles = cfg.max_tiles or t.max_tiles
    if cfg.max_image_tokens is not None:
        budget = cfg.max_image_tokens // spec.tokens_per_tile
        if budget < 1:
            raise ConfigError(f"max_image_tokens {cfg.max_image_tokens} is less than one tile "
                             f"({spec.tokens_per_tile} tokens)")
        thumb_from = 3 if cfg.tiling == "reduced" else 2
        max_tiles = min(max_tiles, budget if budget < thumb_from else budget - 1)
    return TilingConfig(t.tile_size, min(t.min_tiles, max_tiles), max_tiles, t.use_thumbnail,
                        mode=cfg.tiling, upscale_limit=cfg.upscale_limit)


def build_engine(model_cfg: ModelConfig, engine_cfg: EngineConfig) -> tuple[Engine, TilingConfig]:
    """The configured engine and the tiling its images must be prepared with."""
    if engine_cfg.engine == "lmdeploy":
        from pipeline.lmdeploy_engine import LMDeployEngine, require_lmdeploy

        require_lmdeploy()  # before reading the model: fail fast and say what to install
        path = model_cfg.path or DEFAULT_MODEL
        spec = read_spec(path)
        tok = load_tokenizer(path)
        tiling = tiling_for(spec, model_cfg)
        answers = AnswerTokens.from_words(tok, engine_cfg.yes_words, engine_cfg.no_words)
        return LMDeployEngine(str(path), tok, answers, spec.tokens_per_tile, tiling.max_tiles,
                              engine_cfg.max_new_tokens), dataclasses.replace(tiling,
                                                                            keep_pixels=True)
    model = load_model(model_cfg.path, model_cfg.device, model_cfg.torch_dtype,
                       model_cfg.llm_quant)
    backend = engine_cfg.vit_backend
    if backend == "auto":
        backend = default_backend(model_cfg.device)
    # stream-ordered: the engine reads the embeddings on the stream that made them, so the graph
    # pool's host wait per call would only stall the host (16% of a profiled round at
    # InternVL3-1B's shape on an H200, docs/gpu.md)
    vision = make_runner(backend, model, model_cfg.device, cuda_graphs=engine_cfg.cuda_graphs,
                         stream_ordered=True)
    return TorchEngine(model, engine_cfg, vision), tiling_for(model.spec, model_cfg)
