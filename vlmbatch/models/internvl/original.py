"""InternVL's original release layout (``InternVLChatModel``), read without remote code.

Most InternVL users, LMDeploy and the 58.com write-up (InternVL2-8B) use these directories:
``config.json`` with ``architectures: ["InternVLChatModel"]``, ``model_type: internvl_chat``
and

- ``vision_config``: InternViT (``hidden_size``, ``num_hidden_layers``, ``qkv_bias``,
  ``qk_normalization``, ``norm_type``, ``layer_norm_eps``, ``image_size``, ...): the 300M
  tower (layer norm, q/k/v biases) or the 6B one (RMS norm, QK-norm over the whole width, no
  q/k/v biases);
- ``llm_config``: the text model, named by ``architectures[0]`` (``internvl/text.py``:
  InternLM2, Qwen2, Qwen3, Llama; Phi-3 and the MoE ones refused), untied whatever it says
  (``InternVLChatConfig`` sets ``tie_word_embeddings = False``);
- ``template`` (a ``conversation.py`` name, ``templates.py``) and optionally
  ``system_message``; ``select_layer``, ``downsample_ratio``, ``ps_version`` (pixel
  shuffle v1 / v2); tiling: ``dynamic_image_size``, ``use_thumbnail``,
  ``min_dynamic_patch``, ``max_dynamic_patch``, ``force_image_size`` (the tile side);
- weights ``vision_model.*`` (fused ``attn.qkv``, layer scales ``ls1``/``ls2``),
  ``mlp1.{0,1,3}`` (the projector: LayerNorm, Linear, GELU, Linear), ``language_model.*``
  (InternLM2: ``model.tok_embeddings``, ``attention.wqkv``/``wo``, ``feed_forward.w1/w2/w3``,
  ``attention_norm``, ``ffn_norm``, ``output``; Qwen and Llama: transformers' names);
- the tokenizer: Qwen's ``tokenizer.json`` (transformers' own class), or InternLM2's
  SentencePiece ``tokenizer.model`` behind a remote-code class, which
  ``models.tokenizer.SentencePieceTokenizer`` reads instead.

``normalise_key`` maps every weight to the HF-native family's normal form, with the key map
of transformers' ``convert_internvl_weights_to_hf.py`` (vision and projector names); the
fused vision ``qkv`` is split on load (``vision.split_fused_qkv``), InternLM2's ``wqkv``
stays fused (the decoder's grouped layout). ``<IMG_CONTEXT>``'s id is read from the
tokenizer files (the config has none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmbatch.models.base import ModelSpec
from vlmbatch.models.config_io import ModelError, read_json
from vlmbatch.models.internvl.family import IMAGENET_MEAN, IMAGENET_STD, InternVL, InternVLSpec
from vlmbatch.models.internvl.prompt import InternVLPrompts, template_format
from vlmbatch.models.internvl.templates import TEMPLATES, Template
from vlmbatch.models.internvl.text import ARCHITECTURES, check_kind, text_spec
from vlmbatch.models.internvl.vision import VisionSpec
from vlmbatch.models.tokenizer import load_tokenizer
from vlmbatch.preprocessing.prepare import TilingConfig

IMAGE_TOKENS = ("<img>", "<IMG_CONTEXT>", "</img>")  # InternVLChatModel.chat's constants

# transformers' ORIGINAL_TO_CONVERTED_KEY_MAPPING_VISION, applied in this order
_VISION = [(r"vision_model", "vision_tower"), (r"layers", "layer"),
           (r"class_embedding", "cls_token"), (r"position_embedding", "position_embeddings"),
           (r"patch_embedding", "patch_embeddings.projection"), (r"ls(\d+)", r"lambda_\1"),
           (r"attn.proj", "attention.projection_layer"), (r"attn", "attention"),
           (r"norm1", "layernorm_before"), (r"norm2", "layernorm_after")]
_PROJECTOR = {"mlp1.0.": "multi_modal_projector.layer_norm.",
              "mlp1.1.": "multi_modal_projector.linear_1.",
              "mlp1.3.": "multi_modal_projector.linear_2."}
# InternLM2's decoder names -> ours (one dotted segment pair each)
_INTERNLM2 = {"tok_embeddings": "embed_tokens", "attention.wqkv": "self_attn.wqkv",
              "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
              "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
              "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


@dataclass(frozen=True)
class InternVLChatSpec(InternVLSpec):
    template: Template
    system_message: str | None  # the config's, replacing the template's; None: the template's


def _vision_spec(cfg: dict, v: dict, pre: dict, text_hidden: int) -> VisionSpec:
    eps = float(v.get("layer_norm_eps", 1e-6))
    try:
        return VisionSpec(
            hidden=int(v["hidden_size"]), layers=int(v["num_hidden_layers"]),
            heads=int(v["num_attention_heads"]), intermediate=int(v["intermediate_size"]),
            patch=int(v.get("patch_size", 14)), image_size=int(v.get("image_size", 448)),
            norm_type=v.get("norm_type", "rms_norm"), eps=eps,
            qk_norm=bool(v.get("qk_normalization", True)), act=v.get("hidden_act", "gelu"),
            mean_pooling=True,  # InternVisionModel has no final norm
            feature_layer=int(cfg.get("select_layer", -1)), drop_cls=True,
            downsample=float(cfg.get("downsample_ratio", 0.5)), projector_act="gelu",
            text_hidden=text_hidden,
            mean=tuple(pre.get("image_mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
            std=tuple(pre.get("image_std", IMAGENET_STD)),  # type: ignore[arg-type]
            ps_version=str(cfg.get("ps_version", "v1")), qk_norm_eps=eps)
    except ValueError as e:
        raise ModelError(f"vision_config / ps_version: {e}") from e


def _tiling(cfg: dict, v: dict) -> TilingConfig:
    """InternVLChatModel's tiles: ``force_image_size`` (else the tower's) per side; up to
    ``max_dynamic_patch`` tiles plus the thumbnail when ``dynamic_image_size``, else one."""
    size = int(cfg.get("force_image_size") or v.get("image_size", 448))
    if not cfg.get("dynamic_image_size", False):
        return TilingConfig(size, 1, 1, False)
    return TilingConfig(size, int(cfg.get("min_dynamic_patch", 1)),
                        int(cfg.get("max_dynamic_patch", 6)),
                        bool(cfg.get("use_thumbnail", False)))


def added_token_ids(path: Path) -> dict[str, int]:
    """The added tokens' ids from the tokenizer files (tokenizer_config.json's
    ``added_tokens_decoder``, tokenizer.json's ``added_tokens``, added_tokens.json)."""
    found = {str(t["content"]): int(i) for i, t in read_json(
        path / "tokenizer_config.json").get("added_tokens_decoder", {}).items()}
    found.update({str(t["content"]): int(t["id"])
                  for t in read_json(path / "tokenizer.json").get("added_tokens", [])})
    found.update({str(k): int(i) for k, i in read_json(path / "added_tokens.json").items()})
    return found


class InternVLChat(InternVL):
    """``InternVLChatModel`` directories: the InternVL family's modules, prompts from the
    config's template (module docstring)."""

    def read_spec(self, path: Path, config: dict) -> InternVLChatSpec:
        cfg_file = path / "config.json"
        v, t = config.get("vision_config") or {}, config.get("llm_config") or {}
        arch = (t.get("architectures") or [None])[0]
        where = f"{cfg_file}: llm_config"
        text = text_spec(check_kind(ARCHITECTURES.get(arch, arch), where), t, False, where)
        name = config.get("template")
        if name not in TEMPLATES:
            raise ModelError(f"{cfg_file}: template {name!r} is not one we know; known: "
                             f"{', '.join(sorted(TEMPLATES))}")
        token = added_token_ids(path).get("<IMG_CONTEXT>")
        if token is None:
            raise ModelError(f"{path}: the tokenizer files define no <IMG_CONTEXT> token; copy "
                             "the checkpoint's tokenizer_config.json into the folder")
        pre = read_json(path / "preprocessor_config.json")
        try:
            vision = _vision_spec(config, v, pre, text.hidden)
            tiling = _tiling(config, v)
        except (ValueError, KeyError) as e:
            raise ModelError(f"{cfg_file}: {e}") from e
        return InternVLChatSpec(path, "internvl_chat", text, token, vision, tiling,
                                TEMPLATES[name], config.get("system_message"))

    def normalise_key(self, key: str) -> str:
        """An original key -> the HF-native family's normal form (module docstring)."""
        if key.startswith("vision_model."):
            for pattern, repl in _VISION:
                key = re.sub(pattern, repl, key)
        elif key.startswith("mlp1."):
            key = next((new + key[len(old):] for old, new in _PROJECTOR.items()
                        if key.startswith(old)), key)
        elif key.startswith("language_model."):
            for old, new in _INTERNLM2.items():
                key = key.replace(f".{old}.", f".{new}.")
            if key == "language_model.output.weight":
                key = "language_model.lm_head.weight"
        return super().normalise_key(key)

    def load_tokenizer(self, path: Path) -> Any:
        tok = load_tokenizer(path)
        missing = [t for t in IMAGE_TOKENS if tok.convert_tokens_to_ids(t) in (
            None, tok.unk_token_id)]
        if missing:
            raise ModelError(f"the tokenizer in {path} lacks InternVL's image tokens "
                             f"({', '.join(missing)}); copy the checkpoint's tokenizer files "
                             "into the folder")
        return tok

    def prompt_builder(self, tokenizer: Any, spec: ModelSpec) -> InternVLPrompts:
        assert isinstance(spec, InternVLChatSpec)
        return InternVLPrompts(tokenizer, spec.tokens_per_tile, spec.image_token_id,
                               template_format(spec.template, spec.system_message))


INTERNVL_CHAT = InternVLChat()  # the family object models/registry.py names "internvl_chat"
