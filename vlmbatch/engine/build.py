"""``build_engine``: the configured engine, by name from the ``ENGINES`` registry (its table
is in ``engine/config.py``, beside ``--engine``'s declaration), which names each engine's
builder as ``"module:attr"``: listing the engines (the CLI's choices) imports none of them,
building one imports its module. A builder takes
``(ModelConfig, EngineConfig, threads)`` and returns an ``Engine`` (``engine/base.py``);
``threads`` (torch's intra-op threads, None: torch's default) is set there, once, where the
engine is built: a run's, a job's, a model actor's, the server's, the API's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlmbatch.common.registry import UnknownName
from vlmbatch.engine.config import ENGINES, ConfigError, EngineConfig, ModelConfig

if TYPE_CHECKING:
    from vlmbatch.engine.base import Engine


def build_engine(model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 threads: int | None = None) -> Engine:
    """The configured engine, on ``threads`` torch threads (None: torch's default); its
    ``image_plan`` says how to prepare images for it."""
    try:
        builder = ENGINES.get(engine_cfg.engine)
    except UnknownName as e:
        raise ConfigError(str(e)) from None
    engine: Engine = builder(model_cfg, engine_cfg, threads)
    return engine
