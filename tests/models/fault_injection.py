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
(biases and norm shifts 0, norm weights 1 (Qwen3.5's zero-centred norms 0), layer scales,
class token and position embeddings, Qwen3.5's ``dt_bias`` 1), with that constant: a fixture
must move each of them off it. Qwen3.5's ``A_log`` is drawn at random, not listed.

``HYBRID_FAULTS`` are Qwen3.5's: the full attention's output gate dropped (``sigmoid(gate)``
taken as 1), and the linear layers' decay dropped (``A_log`` to -inf: ``exp(g) = 1``, a state
that never forgets).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from vlmbatch.models.decoder import GatedAttention
from vlmbatch.models.layers import CenteredRMSNorm
from vlmbatch.models.linear_attention import GatedDeltaNet

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


def drop_attention_gate(module: nn.Module) -> None:
    """Every gated attention computes as if its output gate were open (no ``sigmoid``)."""
    found = [m for m in module.modules() if isinstance(m, GatedAttention)]
    assert found, "no gated attention found"
    for m in found:
        m.project = functools.partial(_ungated, m)  # type: ignore[method-assign]


def _ungated(m: GatedAttention, h: torch.Tensor) -> tuple:
    q, k, v, _ = GatedAttention.project(m, h)
    return q, k, v, None


def drop_linear_decay(module: nn.Module) -> None:
    """Every Gated DeltaNet keeps its state undecayed (``g = 0``)."""
    found = [m for m in module.modules() if isinstance(m, GatedDeltaNet)]
    assert found, "no linear-attention layer found"
    with torch.no_grad():
        for m in found:
            m.A_log.fill_(float("-inf"))


HYBRID_FAULTS: dict[str, Fault] = {"no_attention_gate": drop_attention_gate,
                                   "no_linear_decay": drop_linear_decay}


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
    centred = {f"{path}.weight" for path, m in module.named_modules()
               if isinstance(m, CenteredRMSNorm)}
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":  # drawn at random
            continue
        if p.dim() == 1 or leaf in ("cls_token", "pos_embed"):
            value = (layer_scale if leaf in ("ls1", "ls2") else 0.0 if name in centred
                     else 1.0 if leaf == "dt_bias" or leaf == "weight" and "norm" in name
                     else 0.0)
            yield name, p, value
