"""Qwen-VL checkpoint specs: ``config.json`` (+ ``preprocessor_config.json``) -> frozen records.

Reads ``model_type`` ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_5`` in both
layouts found in the wild: the hub's flat one (Qwen2/2.5-VL: text settings at the top level,
``rope_scaling`` with ``"type": "mrope"``) and transformers 5's nested ``text_config`` with
``rope_parameters``. The MoE variants (``qwen3_vl_moe``, ``qwen3_5_moe``) are refused with a
clear error. The decoder's spec is ``models.decoder.TextSpec`` (M-RoPE, sectioned or
interleaved).

Qwen3.5 (dense): the vision tower is Qwen3-VL's without DeepStack (its ``VisionSpec.kind`` is
``qwen3_vl``, ``deepstack`` empty unless the config lists ``deepstack_visual_indexes``); the
decoder interleaves Gated DeltaNet layers with gated full attention (``layer_types``, by
default three ``linear_attention`` then one ``full_attention``), zero-centred RMSNorms,
QK-norm, partial rotary (``partial_rotary_factor``, 0.25) with interleaved M-RoPE over the
rotary pairs (``mrope_section`` default (11, 11, 10)), no q/k/v/o biases unless
``attention_bias``. Fallbacks are transformers 5.24's ``Qwen3_5TextConfig`` defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmbatch.models.decoder import TextSpec
from vlmbatch.models.linear_attention import LinearSpec
from vlmbatch.preprocessing.qwen_vl import QWEN2VL_PIXELS, QWEN3VL_PIXELS, QwenVLPreprocess

KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
MOE = {"qwen3_vl_moe": "Qwen3-VL", "qwen3_5_moe": "Qwen3.5"}  # refused (module docstring)
# Qwen3.5's layer_types -> TextSpec.layer_kinds
_LAYER_KINDS = {"linear_attention": "linear", "full_attention": "full"}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


_WIDTH = {"qwen2_vl": 1280, "qwen2_5_vl": 3584, "qwen3_vl": 1152}


class SpecError(ValueError):
    """The checkpoint's config is not one of the Qwen-VL models we implement."""


@dataclass(frozen=True)
class VisionSpec:
    kind: str  # one of KINDS but qwen3_5 (its tower is qwen3_vl's): norm, MLP, windows, ...
    depth: int
    hidden: int  # the tower's width (Qwen2-VL's embed_dim)
    heads: int
    intermediate: int
    act: str
    patch: int
    temporal: int
    merge: int
    out_hidden: int  # the merger's output width = the decoder's hidden size
    rope_theta: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    window: int = 0  # Qwen2.5-VL: window side in pixels (0: no window attention)
    full_attention_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks that attend the image
    position_embeddings: int = 0  # Qwen3-VL: learned table size (side**2)
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output feeds a DeepStack merger

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def row_size(self) -> int:
        return 3 * self.temporal * self.patch * self.patch


@dataclass(frozen=True)
class QwenVLSpec:
    model_type: str
    vision: VisionSpec
    text: TextSpec
    preprocess: QwenVLPreprocess
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    video_token_id: int = 151656  # <|video_pad|>
    # Qwen2.5-VL: temporal positions per second of video (vision_config; transformers'
    # config default where absent); unused by the other kinds
    tokens_per_second: float = 4


def read_qwen_vl_spec(path: Path) -> QwenVLSpec:
    """The spec of the checkpoint directory ``path``."""
    cfg = _read_json(Path(path) / "config.json", required=True)
    return spec_from_config(cfg, _read_json(Path(path) / "preprocessor_config.json"))


def spec_from_config(cfg: dict[str, Any], pre: dict[str, Any] | None = None) -> QwenVLSpec:
    kind = cfg.get("model_type")
    if kind in MOE:
        raise SpecError(f"model_type {kind!r} ({MOE[kind]} MoE) is not supported: only the "
                        f"dense {MOE[kind]} models are implemented (mixture-of-experts decoder "
                        "layers are not)")
    if kind not in KINDS:
        raise SpecError(f"model_type {kind!r} is not a Qwen-VL model; supported: {KINDS}")
    vision = _vision_spec(kind, cfg.get("vision_config") or {}, pre or {})
    text = _text_spec(kind, cfg)
    if vision.out_hidden != text.hidden:
        raise SpecError(f"vision output width {vision.out_hidden} != text hidden {text.hidden}")
    return QwenVLSpec(kind, vision, text, _preprocess(kind, vision, pre or {}),
                      int(cfg.get("image_token_id", 151655)),
                      int(cfg.get("vision_start_token_id", 151652)),
                      int(cfg.get("vision_end_token_id", 151653)),
                      int(cfg.get("video_token_id", 151656)),
                      (cfg.get("vision_config") or {}).get("tokens_per_second", 4))


def _vision_spec(model_type: str, v: dict[str, Any], pre: dict[str, Any]) -> VisionSpec:
    kind = "qwen3_vl" if model_type == "qwen3_5" else model_type  # the tower's kind
    qwen2, qwen3 = kind == "qwen2_vl", kind == "qwen3_vl"
    deepstack = (8, 16, 24) if model_type == "qwen3_vl" else ()
    # fallbacks are transformers' config defaults; released checkpoints set every one
    hidden = int(v.get("embed_dim" if qwen2 else "hidden_size", _WIDTH[kind]))
    mean = pre.get("image_mean", (0.5,) * 3 if qwen3 else CLIP_MEAN)
    std = pre.get("image_std", (0.5,) * 3 if qwen3 else CLIP_STD)
    rope = v.get("rope_parameters") or {}
    return VisionSpec(
        kind=kind, depth=int(v.get("depth", 27 if qwen3 else 32)), hidden=hidden,
        heads=int(v.get("num_heads", 16)),
        intermediate=int(hidden * v.get("mlp_ratio", 4)) if qwen2
        else int(v.get("intermediate_size", 4304 if qwen3 else 3420)),
        act=v.get("hidden_act", "quick_gelu" if qwen2 else
                  "gelu_pytorch_tanh" if qwen3 else "silu"),
        patch=int(v.get("patch_size", 16 if qwen3 else 14)),
        temporal=int(v.get("temporal_patch_size", 2)),
        merge=int(v.get("spatial_merge_size", 2)),
        out_hidden=int(v.get("hidden_size", 3584) if qwen2 else v.get("out_hidden_size", 3584)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        mean=tuple(float(x) for x in mean),  # type: ignore[arg-type]
        std=tuple(float(x) for x in std),  # type: ignore[arg-type]
        window=int(v.get("window_size", 112)) if kind == "qwen2_5_vl" else 0,
        full_attention_blocks=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31)))
        if kind == "qwen2_5_vl" else (),
        position_embeddings=int(v.get("num_position_embeddings", 2304)) if qwen3 else 0,
        deepstack=tuple(v.get("deepstack_visual_indexes", deepstack)) if qwen3 else ())


def _text_spec(kind: str, cfg: dict[str, Any]) -> TextSpec:
    top = {k: x for k, x in cfg.items() if k not in ("text_config", "vision_config")}
    t = {**top, **(cfg.get("text_config") or {})}  # hub Qwen2/2.5-VL configs are flat
    qwen3 = kind in ("qwen3_vl", "qwen3_5")
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise SpecError(f"{kind}: rope type {rope.get('rope_type', rope.get('type'))!r} is not "
                        "supported (only the default M-RoPE)")
    if t.get("use_sliding_window"):
        raise SpecError(f"{kind}: sliding-window attention in the decoder is not supported")
    heads = int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or (256 if kind == "qwen3_5"
                                         else int(t["hidden_size"]) // heads))
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", t.get(
        "partial_rotary_factor", 0.25 if kind == "qwen3_5" else 1.0))))
    section = tuple(int(s) for s in rope.get("mrope_section", _SECTIONS[kind]))
    if len(section) != 3 or sum(section) != rotary // 2:
        raise SpecError(f"{kind}: mrope_section {section} must be 3 numbers summing to "
                        f"the rotary pairs, {rotary // 2}")
    tie = cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get(
        "tie_word_embeddings", False)
    hybrid = _hybrid(t) if kind == "qwen3_5" else {}
    try:
        return TextSpec(
            vocab=int(t["vocab_size"]), hidden=int(t["hidden_size"]),
            layers=int(t["num_hidden_layers"]), heads=heads,
            kv_heads=int(t.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate=int(t["intermediate_size"]),
            eps=float(t.get("rms_norm_eps", 1e-6 if qwen3 else 1e-5)),
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta",
                                                          5e5 if qwen3 else 1e6))),
            rope="mrope-interleaved" if qwen3 else "mrope-sectioned", mrope_section=section,
            rotary_dim=None if rotary == head_dim else rotary,
            qk_norm=qwen3, qkv_bias=bool(t.get("attention_bias", False)) if qwen3 else True,
            o_bias=bool(t.get("attention_bias", False)) if qwen3 else False,
            act=t.get("hidden_act", "silu"), tie_embeddings=bool(tie),
            max_positions=int(t.get("max_position_embeddings") or 0), **hybrid)
    except ValueError as e:  # a decoder TextSpec cannot build
        raise SpecError(f"{kind}: text config: {e}") from e


_SECTIONS = {"qwen2_vl": (16, 24, 24), "qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20),
             "qwen3_5": (11, 11, 10)}  # transformers' mrope_section defaults


def _hybrid(t: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's TextSpec options: layer kinds, linear-attention sizes, gated attention and
    zero-centred norms (module docstring)."""
    n = int(t["num_hidden_layers"])
    every = int(t.get("full_attention_interval", 4))
    types = t.get("layer_types") or ["full_attention" if (i + 1) % every == 0
                                     else "linear_attention" for i in range(n)]
    if bad := sorted(set(types) - set(_LAYER_KINDS)):
        raise SpecError(f"qwen3_5: layer_types {bad} are not supported (only "
                        f"{sorted(_LAYER_KINDS)})")
    try:
        linear = LinearSpec(conv_kernel=int(t.get("linear_conv_kernel_dim", 4)),
                            key_heads=int(t.get("linear_num_key_heads", 16)),
                            value_heads=int(t.get("linear_num_value_heads", 32)),
                            key_dim=int(t.get("linear_key_head_dim", 128)),
                            value_dim=int(t.get("linear_value_head_dim", 128)))
    except ValueError as e:
        raise SpecError(f"qwen3_5: text config: {e}") from e
    return dict(layer_kinds=tuple(_LAYER_KINDS[x] for x in types), linear=linear,
                attn_gate=True, centered_norm=True)


def _preprocess(kind: str, v: VisionSpec, pre: dict[str, Any]) -> QwenVLPreprocess:
    lo, hi = QWEN3VL_PIXELS if kind in ("qwen3_vl", "qwen3_5") else QWEN2VL_PIXELS
    size = pre.get("size") or {}
    cfg = QwenVLPreprocess(
        patch=int(pre.get("patch_size", v.patch)), merge=int(pre.get("merge_size", v.merge)),
        temporal=int(pre.get("temporal_patch_size", v.temporal)),
        # as the image processor: min_pixels / max_pixels, when given, override "size"
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge", lo)),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge", hi)))
    if (cfg.patch, cfg.merge, cfg.temporal) != (v.patch, v.merge, v.temporal):
        raise SpecError(f"preprocessor patch/merge/temporal {cfg.patch}/{cfg.merge}/"
                        f"{cfg.temporal} != the vision tower's {v.patch}/{v.merge}/{v.temporal}")
    return cfg


def _read_json(p: Path, required: bool = False) -> dict[str, Any]:
    if not p.is_file():
        if required:
            raise SpecError(f"no {p.name} in {p.parent}")
        return {}
    d = json.loads(p.read_text())
    if not isinstance(d, dict):
        raise SpecError(f"{p} is not a JSON object")
    return d
