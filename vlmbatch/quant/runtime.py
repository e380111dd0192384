"""Swapping a loaded float decoder's linears for their quantised runtime forms (gpt-fast's
``convert_for_runtime``): W4A16 ``Int4Linear`` from a checkpoint's packed weights, or torch's
dynamic int8 linears. ``engine/loading.py`` calls these after a family has built the float
model, so no loader imports this package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmbatch.quant.int4 import Int4Linear


class QuantError(ValueError):
    """A quantised checkpoint or option that cannot be served; the message says why."""


def convert_for_runtime(llm: nn.Module, int4: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        group_size: int, device: torch.device | str, dtype: torch.dtype,
                        param_of: Callable[[str], str | None]) -> int:
    """Replace each linear named in ``int4`` (normalised weight keys, ``quant.checkpoint.
    int4_weights``) by an ``Int4Linear`` on ``device``; ``param_of`` maps a key to our
    parameter name (``ModelFamily.llm_param``). Returns how many were swapped."""
    for key, (q, scale) in int4.items():
        parent, name = _linear_of(llm, key, param_of(key))
        old = getattr(parent, name)
        setattr(parent, name, Int4Linear(q, scale, old.bias, group_size, device, dtype))
    return len(int4)


def int8_dynamic(llm: nn.Module) -> nn.Module:
    """``llm`` with every ``nn.Linear`` as torch's dynamically quantised int8 linear (CPU,
    float32 activations)."""
    return torch.ao.quantization.quantize_dynamic(llm, {nn.Linear}, dtype=torch.qint8)


def _linear_of(llm: nn.Module, key: str, param: str | None) -> tuple[nn.Module, str]:
    """``layers.0.self_attn.q_proj.weight`` -> (layer 0's attention, "q_proj");
    QuantError if not a linear."""
    if param is None or not param.endswith(".weight"):
        raise QuantError(f"quantised tensor {key} is not a decoder-layer linear")
    *path, name, _ = param.split(".")
    parent = llm.get_submodule(".".join(path))
    if not isinstance(getattr(parent, name, None), nn.Linear):
        raise QuantError(f"quantised tensor {key}: no linear {name!r} in our decoder layer")
    return parent, name
