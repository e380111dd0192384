"""Model families by ``model_type``; ``family_for`` reads a checkpoint's config.json and
picks one (the message for another type lists the supported ones)."""

from __future__ import annotations

from pathlib import Path

from vlmbatch.common.registry import Registry
from vlmbatch.models.base import ModelFamily
from vlmbatch.models.io import ModelError, read_config

FAMILIES: Registry[ModelFamily] = Registry("model type")
# model types a family knows and refuses: model_type -> why (e.g. Qwen3-VL MoE)
REFUSED: dict[str, str] = {}


def family_for(path: Path) -> tuple[ModelFamily, dict]:
    """(family, config.json) of the checkpoint at ``path``."""
    cfg = read_config(path)
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED:
        raise ModelError(f"{path / 'config.json'}: model_type {model_type!r}: "
                         f"{REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ModelError(f"{path / 'config.json'}: model_type {model_type!r} is not supported; "
                         f"vlmbatch reads HF-native checkpoints of model_type "
                         f"{', '.join(repr(n) for n in FAMILIES.names())} (e.g. the '-hf' "
                         "InternVL2.5/3 releases, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    return FAMILIES.get(model_type), cfg
