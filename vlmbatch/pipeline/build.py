"""``build_engine``: the configured engine, by name from the ``ENGINES`` registry. Every
engine module registers itself when imported; this module imports them all, so whoever
builds an engine (or lists the engines: the CLI's choices) imports this."""

from __future__ import annotations

from vlmbatch.common.registry import UnknownName
from vlmbatch.pipeline import lmdeploy_engine as _lmdeploy  # noqa: F401  (registers "lmdeploy")
from vlmbatch.pipeline import torch_engine as _torch  # noqa: F401  (registers "torch")
from vlmbatch.pipeline.config import ConfigError, EngineConfig, ModelConfig
from vlmbatch.pipeline.engine import ENGINES, Engine

__all__ = ["ENGINES", "build_engine"]


def build_engine(model_cfg: ModelConfig, engine_cfg: EngineConfig) -> Engine:
    """The configured engine; its ``image_plan`` says how to prepare images for it."""
    try:
        builder = ENGINES.get(engine_cfg.engine)
    except UnknownName as e:
        raise ConfigError(str(e)) from None
    return builder(model_cfg, engine_cfg)
