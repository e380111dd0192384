"""Bugs injected into our models, to show that the reference tests catch them (STYLE 19).

Each fault edits a deep copy of one of our modules (never the reference): the reference
test's comparison run on the faulty copy must then miss transformers by far more than its
tolerance. Two kinds, both silent on weights that transformers initialises (zero biases) or
that barely move the output:

- ``drop_qkv_biases``: attention without its q/k/v biases (released Qwen2 decoders and
  InternViT-300M have them, large; InternLM2's fused ``wqkv`` too);
- ``swap_query_heads``: the rows of query heads 0 and 1 exchanged in the q projection
  (weights and bias; in InternLM2's grouped ``wqkv``, its first two row blocks, kv head 0's
  query heads), i.e. a head-order bug in a reshape; heads 0 and 1 share a key/value head
  under GQA, the subtle case.

``constant_init_parameters`` lists the parameters transformers initialises to a constant
(biases and norm shifts 0, norm weights 1, layer scales, class token and position
embeddings), with that constant: a fixture must move each of them off it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

Fault = Callable[[nn.Module], None]


def _linears(module: nn.Module, names: tuple[str, ...]) -> Iterator[tuple[str, nn.Linear]]:
    for path, m in module.named_modules():
        if isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] in names:
            yield path, m


def drop_qkv_biases(module: nn.Module) -> None:
    """Zero every q/k/v projection's bias (decoder ``q_proj``/``k_proj``/``v_proj``,
    InternViT's the same, Qwen-VL towers' fused ``qkv``)."""
    found = list(_linears(module, ("q_proj", "k_proj", "v_proj", "qkv", "wqkv")))
    assert found, "no q/k/v projection found"
    for path, lin in found:
        assert lin.bias is not None, f"{path} has no bias to drop"
        with torch.no_grad():
            lin.bias.zero_()


def swap_query_heads(module: nn.Module) -> None:
    """Exchange query heads 0 and 1 in the first attention of ``module``: rows [0, d) and
    [d, 2d) of its q projection (the q part of a fused ``qkv``, which comes first), weight
    and bias. ``module.spec.heads``: its query heads."""
    path, lin = next(_linears(module, ("q_proj", "qkv", "wqkv")))
    heads = int(module.spec.heads)  # type: ignore[union-attr]
    if path.endswith("wqkv"):  # InternLM2's grouped rows: kv head 0's query heads first
        d = lin.out_features // (heads + 2 * int(module.spec.kv_heads))  # type: ignore[union-attr]
    else:
        d = (lin.out_features // 3 if path.endswith("qkv") else lin.out_features) // heads
    with torch.no_grad():
        for t in (lin.weight, lin.bias):
            if t is not None:
                first = t[:d].clone()
                t[:d] = t[d: 2 * d]
                t[d: 2 * d] = first


FAULTS: dict[str, Fault] = {"no_qkv_biases": drop_qkv_biases,
                            "query_heads_0_1_swapped": swap_query_heads}


def with_fault(module: nn.Module, fault: Fault) -> nn.Module:
    """A deep copy of ``module`` with ``fault`` applied."""
    faulty = copy.deepcopy(module)
    fault(faulty)
    return faulty


def constant_init_parameters(module: nn.Module, layer_scale: float
                             ) -> Iterator[tuple[str, nn.Parameter, float]]:
    """(name, parameter, transformers' constant) of every constant-initialised parameter:
    every 1-D one (norm weights 1, biases and norm shifts 0, InternViT's layer scales
    ``ls1``/``ls2`` the config's ``layer_scale``), and InternViT's class token and position
    table (0)."""
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() == 1 or leaf in ("cls_token", "pos_embed"):
            value = (layer_scale if leaf in ("ls1", "ls2")
                     else 1.0 if leaf == "weight" and "norm" in name else 0.0)
            yield name, p, value
