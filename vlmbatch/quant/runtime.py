"""Swapping a loaded float decoder's linears for their quantised runtime forms (gpt-fast's
``convert_for_runtime``): W4A16 ``Int4Linear`` from a checkpoint's packed weights, or torch's
dynamic int8 linears. ``engine/loading.py`` calls these after a family has built the float
model, so no loader imports this package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmbatch.models.layers import unfuse
from vlmbatch.quant.int4 import Int4Linear


class QuantError(ValueError):
    """A quantised checkpoint or option that cannot be served; the message says why."""


def convert_for_runtime(llm: nn.Module, int4: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        group_size: int, device: torch.device | str, dtype: torch.dtype,
                        param_of: Callable[[str], str | None]) -> int:
    """Replace each linear named in ``int4`` (normalised weight keys, ``quant.checkpoint.
    int4_weights``) by an ``Int4Linear`` on ``device``; ``param_of`` maps a key to our
    parameter name (``ModelFamily.llm_param``). Returns how many were swapped.

    A decoder whose projections are fused (``models.layers.fuse_projections``: q/k/v as
    ``qkv_proj``, gate/up as ``gate_up_proj``) gets one ``Int4Linear`` per fused linear,
    its parts' int4 rows and scales concatenated in order: the scales are per (row, group),
    so this is the same layer as the parts side by side (tests/quant/test_fusion.py). A
    fused linear only some of whose parts are quantised is split back first."""
    fused: dict[tuple[str, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key, (q, scale) in int4.items():
        path, name = _place(key, param_of(key))
        parent = llm.get_submodule(path)
        joined = next((f for f, parts in getattr(parent, "fusions", {}).items()
                       if name in dict(parts)), None)
        if joined is not None:
            fused.setdefault((path, joined), {})[name] = (q, scale)
            continue
        old = _linear(parent, name, key)
        setattr(parent, name, Int4Linear(q, scale, old.bias, group_size, device, dtype))
    for (path, joined), got in fused.items():
        parent = llm.get_submodule(path)
        fusions: dict[str, tuple[tuple[str, int], ...]] = getattr(parent, "fusions")  # noqa: B009
        parts = [p for p, _ in fusions[joined]]
        if set(got) != set(parts):  # a partly quantised group: its parts apart again
            unfuse(parent, joined)
            for name, (q, scale) in got.items():
                old = _linear(parent, name, name)
                setattr(parent, name, Int4Linear(q, scale, old.bias, group_size, device,
                                                 dtype))
            continue
        old = _linear(parent, joined, joined)
        q = torch.cat([got[p][0] for p in parts])
        scale = torch.cat([got[p][1] for p in parts])
        setattr(parent, joined, Int4Linear(q, scale, old.bias, group_size, device, dtype))
    return len(int4)


def int8_dynamic(llm: nn.Module) -> nn.Module:
    """``llm`` with every ``nn.Linear`` as torch's dynamically quantised int8 linear (CPU,
    float32 activations)."""
    return torch.ao.quantization.quantize_dynamic(llm, {nn.Linear}, dtype=torch.qint8)


def _place(key: str, param: str | None) -> tuple[str, str]:
    """``layers.0.self_attn.q_proj.weight`` -> ("layers.0.self_attn", "q_proj");
    QuantError if not a weight."""
    if param is None or not param.endswith(".weight"):
        raise QuantError(f"quantised tensor {key} is not a decoder-layer linear")
    *path, name, _ = param.split(".")
    return ".".join(path), name


def _linear(parent: nn.Module, name: str, key: str) -> nn.Linear:
    """``parent``'s linear ``name``; QuantError if it has none."""
    old = getattr(parent, name, None)
    if not isinstance(old, nn.Linear):
        raise QuantError(f"quantised tensor {key}: no linear {name!r} in our decoder layer")
    return old
