"""Multimodal calibration and the layer-by-layer AWQ / GPTQ pass over the language model.

Calibration runs the real serving path (``pipeline.drive.answer_group`` -> ``TorchEngine``) on
the user's own images and questions, with the prefix cache off so every prompt is prefilled
whole: the language model sees image embeddings exactly as it will when serving. Forward
hooks on one decoder layer's linears record what they read; then that layer is quantised,
its weights replaced by their dequantised values, and the next layer is calibrated on the
outputs of the already-quantised layers (as GPTQ's sequential scheme does). The vision
encoder and ``lm_head``/embeddings stay in full precision.

Padding rows of the engine's right-padded batches are recorded too (hooks see whole
tensors); prompts are sorted by length before batching, so they are few.

Layers are read by their modules' names (``q_proj``, ``input_layernorm``, ...) wherever
they sit in a decoder layer (``models.decoder``'s nest them as transformers does:
``layers.0.self_attn.q_proj``); ``layer_module`` finds them by the last name.

Result: ``{our linear name ("layers.0.self_attn.q_proj"): (q int8 [N, K], scale float32
[N, G])}``;
the ``LoadedModel`` passed in is modified in place (AWQ also rescales norms and the linears
that feed ``down_proj`` / ``o_proj``), and ``quant.checkpoint.save_quantized`` writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from vlmbatch.models.base import Decoder
from vlmbatch.quant import GROUP_SIZE, METHODS
from vlmbatch.quant.awq import awq_scale
from vlmbatch.quant.gptq import Hessian, gptq
from vlmbatch.quant.int4 import dequantize, rtn

QWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Group:
    """Linears reading one input, and what produces that input (for AWQ's folding)."""
    linears: tuple[str, ...]
    producer: str | None  # "norm:<attr>" | "rows:<linear>" | None (cannot fold)


def layer_groups(heads: int, kv_heads: int, qkv_layout: str = "separate") -> list[Group]:
    """A decoder layer's linears by the input they read (``qkv_layout``: the spec's; the
    grouped one's q, k, v are the rows of one ``wqkv``)."""
    # o_proj reads attention output, linear in v_proj's rows only when every query head has
    # its own value head; with grouped-query attention no per-channel fold exists, nor with
    # the grouped layout (its value rows are interleaved with q and k in wqkv: not folded).
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    o_producer = "rows:v_proj" if heads == kv_heads else None
    if qkv_layout == "grouped":
        qkv, o_producer = ("wqkv",), None
    return [Group(qkv, "norm:input_layernorm"), Group(("o_proj",), o_producer),
            Group(("gate_proj", "up_proj"), "norm:post_attention_layernorm"),
            Group(("down_proj",), "rows:up_proj")]


def layer_module(layer: torch.nn.Module, name: str) -> tuple[str, torch.nn.Module]:
    """(path, module) of the one submodule of ``layer`` whose name ends in ``name``."""
    found = [(path, m) for path, m in layer.named_modules() if path.rsplit(".", 1)[-1] == name]
    if len(found) != 1:
        raise ValueError(f"decoder layer has {len(found)} modules named {name!r}")
    return found[0]


def layer_linear(layer: torch.nn.Module, name: str) -> tuple[str, torch.nn.Linear]:
    """``layer_module`` for a linear (``q_proj``, ...)."""
    path, m = layer_module(layer, name)
    if not isinstance(m, torch.nn.Linear):
        raise ValueError(f"decoder layer's {path} is {type(m).__name__}, not a linear")
    return path, m


class _Recorder:
    """Inputs of the first linear of each group: a Hessian (GPTQ) or sampled rows (AWQ)."""

    def __init__(self, k: int, keep_rows: bool, max_rows: int) -> None:
        # a K x K float64 Hessian only for GPTQ (189 MB at Qwen2-0.5B's down_proj width)
        self.hessian = None if keep_rows else Hessian(k)
        self.rows: list[torch.Tensor] = []
        self.keep_rows, self.max_rows, self.n = keep_rows, max_rows, 0

    def __call__(self, _mod: torch.nn.Module, args: tuple, _out: torch.Tensor) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()
        if self.keep_rows:
            if self.n < self.max_rows:
                self.rows.append(x[: self.max_rows - self.n])
                self.n += min(len(x), self.max_rows - self.n)
        else:
            assert self.hessian is not None
            self.hessian.add(x)


def quantize_llm(llm: Decoder, run_calibration: Callable[[], None], method: str,
                 group_size: int = GROUP_SIZE, max_rows: int = 8192,
                 progress: bool = True) -> tuple[QWeights, list[dict]]:
    """Quantise every decoder-layer linear of ``llm`` (a family's ``Decoder``) in place.

    ``run_calibration()`` must push the calibration set through the model once (it is called
    once per layer). Returns (int4 weights by linear name, one report dict per group).
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} not one of {METHODS}")
    spec = llm.spec
    qweights: QWeights = {}
    report: list[dict] = []
    for li, layer in enumerate(tqdm(llm.layers, desc=f"{method} layers", disable=not progress)):
        groups = layer_groups(spec.heads, spec.kv_heads, spec.qkv_layout)
        recs, handles = {}, []
        if method != "rtn":
            for g in groups:
                lin = layer_linear(layer, g.linears[0])[1]
                recs[g] = _Recorder(lin.in_features, method == "awq", max_rows)
                handles.append(lin.register_forward_hook(recs[g]))
            try:
                run_calibration()
            finally:
                for h in handles:
                    h.remove()
        with torch.no_grad():
            entries = {g: {"layer": li, "linears": "+".join(g.linears)} for g in groups}
            if method == "awq":  # all scales first: folds touch v_proj/up_proj of other groups
                for g in groups:
                    lins = [layer_linear(layer, n)[1] for n in g.linears]
                    s, err, err_rtn = awq_scale([m.weight for m in lins],
                                                torch.cat(recs[g].rows), group_size)
                    if g.producer is not None:
                        apply_scale(layer, g, s)
                    entries[g].update(mse=err if g.producer else err_rtn, mse_rtn=err_rtn)
            for g in groups:
                for name in g.linears:
                    path, m = layer_linear(layer, name)
                    if method == "gptq":
                        hess = recs[g].hessian
                        assert hess is not None  # gptq keeps a Hessian, never rows
                        q, scale = gptq(m.weight, hess.h, group_size)
                    else:
                        q, scale = rtn(m.weight, group_size)
                    m.weight.copy_(dequantize(q, scale, group_size, m.weight.dtype))
                    qweights[f"layers.{li}.{path}"] = (q.cpu(), scale.cpu())
                report.append(entries[g])
    return qweights, report


def apply_scale(layer: torch.nn.Module, group: Group, s: torch.Tensor) -> None:
    """Scale the group's weight columns by ``s [K]`` and divide what produces their input by
    ``s``: the layer's full-precision output is unchanged."""
    assert group.producer is not None
    kind, name = group.producer.split(":")
    if kind == "norm":
        w = layer_module(layer, name)[1].weight
        assert isinstance(w, torch.Tensor)
        w.div_(s.to(w.device, w.dtype))
    else:  # rows of the previous linear
        mod = layer_linear(layer, name)[1]
        mod.weight.div_(s.to(mod.weight.device, mod.weight.dtype)[:, None])
        if mod.bias is not None:
            mod.bias.div_(s.to(mod.bias.device, mod.bias.dtype))
    for lin in group.linears:
        w = layer_linear(layer, lin)[1].weight
        w.mul_(s.to(w.device, w.dtype))
