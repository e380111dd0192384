"""Model families by ``model_type``; ``family_for`` reads a checkpoint's config.json and
picks one (the message for another type lists the supported ones).

``FAMILIES`` names each family object as ``"module:attr"``: listing the model types, or
refusing one, imports no family (nor torch, nor transformers); ``get`` imports the family's
module on first use. ``REFUSED``: model types a family knows and refuses, with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vlmbatch.common.registry import Registry
from vlmbatch.models.config_io import ModelError, read_config

if TYPE_CHECKING:
    from vlmbatch.models.base import ModelFamily, ModelSpec

_QWEN_VL = "vlmbatch.models.qwen_vl.family:QWEN_VL"  # one family object for the three kinds
FAMILIES: Registry[ModelFamily] = Registry("model type", {
    "internvl": "vlmbatch.models.internvl.family:INTERNVL",
    "internvl_chat": "vlmbatch.models.internvl.original:INTERNVL_CHAT",  # original layout
    "qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL, "qwen3_vl": _QWEN_VL,  # qwen_vl.spec.KINDS
    "qwen3_5": _QWEN_VL,
    "colqwen2": "vlmbatch.models.qwen_vl.family:COLQWEN2_FAMILY",
})
REFUSED: dict[str, str] = {
    "qwen3_vl_moe": ("Qwen3-VL MoE is not supported: its mixture-of-experts decoder layers "
                     "are not implemented; the dense Qwen3-VL models (model_type 'qwen3_vl') "
                     "are"),
    "qwen3_5_moe": ("Qwen3.5 MoE (35B-A3B and larger) is not supported: its mixture-of-experts "
                    "decoder layers are not implemented; the dense Qwen3.5 models (model_type "
                    "'qwen3_5') are"),
}


def family_for(path: Path) -> tuple[ModelFamily, dict]:
    """(family, config.json) of the checkpoint at ``path``."""
    cfg = read_config(path)
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED:
        raise ModelError(f"{path / 'config.json'}: model_type {model_type!r}: "
                         f"{REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ModelError(f"{path / 'config.json'}: model_type {model_type!r} is not supported; "
                         f"vlmbatch reads checkpoints of model_type "
                         f"{', '.join(repr(n) for n in FAMILIES.names())} (e.g. InternVL2 to "
                         "3.5 in their original or '-hf' layout, Qwen2-VL, Qwen2.5-VL, "
                         "Qwen3-VL, Qwen3.5)")
    return FAMILIES.get(model_type), cfg


def spec_of(family: ModelFamily, path: Path, cfg: dict) -> ModelSpec:
    """``family``'s sizes of the checkpoint at ``path`` (``cfg``: its config.json); a field
    the family needs and the file lacks, or holds as another kind of value, is a ModelError
    naming the file and the field, the same for every family and every command."""
    cfg_file = path / "config.json"
    try:
        return family.read_spec(path, cfg)
    except KeyError as e:
        raise ModelError(f"{cfg_file}: no field {e.args[0]!r}, which a {cfg.get('model_type')!r} "
                         "checkpoint needs: the file is incomplete; restore the checkpoint's "
                         "original config.json") from None
    except TypeError as e:  # e.g. int(None): a field present with the wrong kind of value
        raise ModelError(f"{cfg_file}: a field holds a value of the wrong kind ({e}); restore "
                         "the checkpoint's original config.json") from None
