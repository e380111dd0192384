"""InternVL's text models as ``models.decoder.TextSpec``: one reader for both layouts.

An HF-native checkpoint names its text model by ``text_config.model_type``; an original
``InternVLChatModel`` one by ``llm_config.architectures[0]`` (``ARCHITECTURES`` maps it to
the same names). What each kind is in the one decoder:

- ``qwen2`` (InternVL2-1B, 2.5-1B/4B/38B/78B, 3-1B/2B/8B/14B/38B/78B): q/k/v biases, no o
  bias;
- ``qwen3`` (InternVL3.5-1B/2B/4B/8B/14B/38B): QK-norm, ``head_dim`` explicit, q/k/v/o
  biases iff ``attention_bias`` (False in every release);
- ``llama`` (InternVL2-40B/76B in the original layout, and the ``-hf`` conversions of
  InternLM2-based releases): biases iff ``attention_bias``;
- ``internlm2`` (InternVL2-2B/8B/26B, 2.5-2B/8B/26B in the original layout): fused
  grouped ``wqkv`` (``qkv_layout="grouped"``), biases iff ``bias``.

Rotary: the default, or (``llama``, ``internlm2``) ``linear`` / ``dynamic`` scaling, which
InternLM2 chat models ask for (``rope_scaling: {type: dynamic, factor: 2.0}``). Refused with
the supported list: other text models, mixture-of-experts ones (``MOE``: InternVL3.5's
GPT-OSS and Qwen3-MoE releases), sliding-window attention, other rope types, MLP biases.
"""

from __future__ import annotations

from typing import Any

from vlmbatch.models.config_io import ModelError
from vlmbatch.models.decoder import TextSpec

TEXT_MODELS = ("qwen2", "qwen3", "llama", "internlm2")
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "LlamaForCausalLM": "llama", "InternLM2ForCausalLM": "internlm2"}
MOE = {"qwen3_moe": "Qwen3 MoE (InternVL3.5-30B-A3B, -241B-A28B)",
       "gpt_oss": "GPT-OSS (InternVL3.5-GPT-OSS-20B-A4B)",
       "Qwen3MoeForCausalLM": "Qwen3 MoE (InternVL3.5-30B-A3B, -241B-A28B)",
       "GptOssForCausalLM": "GPT-OSS (InternVL3.5-GPT-OSS-20B-A4B)"}
_SCALED = ("llama", "internlm2")  # kinds whose rotary may be scaled


def check_kind(kind: Any, where: str, kinds: tuple[str, ...] = TEXT_MODELS) -> str:
    """``kind`` if it is one of ``kinds``; ModelError naming them otherwise."""
    names = ", ".join(repr(k) for k in kinds)
    if kind in MOE:
        raise ModelError(f"{where}: text model {kind!r} is a mixture-of-experts model "
                         f"({MOE[kind]}), which is not supported: its expert layers are not "
                         f"implemented; the dense text models are ({names})")
    if kind not in kinds:
        raise ModelError(f"{where}: text model {kind!r} is not supported; supported: {names}")
    return str(kind)


def _rope(kind: str, t: dict, where: str) -> tuple[float, str, float]:
    """(theta, scaling, factor) from transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling``."""
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling == "default":
        return theta, "none", 1.0
    if scaling not in ("linear", "dynamic") or kind not in _SCALED:
        raise ModelError(f"{where}: rope type {scaling!r} is not supported for a {kind} text "
                         f"model (supported: default; linear and dynamic for "
                         f"{', '.join(_SCALED)})")
    return theta, scaling, float(rope.get("factor", 1.0))


def text_spec(kind: str, t: dict, tie: bool, where: str) -> TextSpec:
    """The decoder spec of a text config ``t`` of kind ``kind`` (``check_kind``); ModelError
    naming ``where`` (the config file and section) for what the decoder cannot build."""
    if t.get("use_sliding_window"):
        raise ModelError(f"{where}: sliding-window attention is not supported")
    if t.get("mlp_bias"):
        raise ModelError(f"{where}: MLP biases (mlp_bias) are not supported")
    theta, scaling, factor = _rope(kind, t, where)
    heads, hidden = int(t["num_attention_heads"]), int(t["hidden_size"])
    bias = {"qwen2": True, "internlm2": bool(t.get("bias", True))}.get(
        kind, bool(t.get("attention_bias", False)))
    head_dim = hidden // heads if kind == "internlm2" else int(
        t.get("head_dim") or (128 if kind == "qwen3" else hidden // heads))
    try:
        return TextSpec(
            vocab=int(t["vocab_size"]), hidden=hidden, layers=int(t["num_hidden_layers"]),
            heads=heads, kv_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=head_dim, intermediate=int(t["intermediate_size"]),
            eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=theta, tie_embeddings=tie,
            rope="1d", qk_norm=kind == "qwen3", qkv_bias=bias,
            o_bias=bias and kind != "qwen2", act=t.get("hidden_act", "silu"),
            qkv_layout="grouped" if kind == "internlm2" else "separate",
            rope_scaling=scaling, rope_factor=factor,
            max_positions=int(t.get("max_position_embeddings") or 0))
    except ValueError as e:  # a decoder TextSpec cannot build
        raise ModelError(f"{where}: {e}") from e
