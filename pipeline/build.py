"""``build_engine``: the configured engine, by name from the ``ENGINES`` registry (every
engine module registers itself when ``pipeline`` is imported)."""

from __future__ import annotations

from common.registry import UnknownName
from pipeline.config import ConfigError, EngineConfig, ModelConfig
from pipeline.engine import ENGINES, Engine


def build_engine(model_cfg: ModelConfig, engine_cfg: EngineConfig) -> Engine:
    """The configured engine; its ``image_plan`` says how to prepare images for it."""
    try:
        builder = ENGINES.get(engine_cfg.engine)
    except UnknownName as e:
        raise ConfigError(str(e)) from None
    return builder(model_cfg, engine_cfg)
