"""The InternVL family: HF-native ``InternVLForConditionalGeneration`` checkpoints with a Qwen2,
Qwen3 or Llama text model (the ``-hf`` InternVL2.5/3/3.5 releases, and the built-in model):
``models.decoder`` with the spec ``internvl/text.py`` reads (1-D rotary; Qwen2's q/k/v biases,
Qwen3's QK-norm).

A model directory holds ``config.json`` (``model_type: internvl``), ``model.safetensors`` or a
sharded ``model.safetensors.index.json``, the tokenizer files and optionally
``preprocessor_config.json`` (tile size, min/max tiles, mean/std). transformers is used only
to read the tokenizer; the weights go straight from safetensors into our modules.

Key layouts accepted: what transformers 5 saves (``vision_tower.*``,
``language_model.model.*``), the 4.5x hub layout (``model.vision_tower.*``,
``model.language_model.*``, ``lm_head.*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmbatch.models.base import ImageOptions, ModelFamily, ModelSpec
from vlmbatch.models.config_io import ModelError, read_json
from vlmbatch.models.decoder import TextDecoder, TextSpec
from vlmbatch.models.internvl.prompt import InternVLPrompts
from vlmbatch.models.internvl.text import check_kind, text_spec
from vlmbatch.models.internvl.vision import VisionEncoder, VisionSpec
from vlmbatch.models.io import load_weights
from vlmbatch.models.tokenizer import check_tokenizer, load_tokenizer
from vlmbatch.preprocessing.prepare import TilingConfig
from vlmbatch.preprocessing.resize import reference_kernel

HF_TEXT_MODELS = ("qwen2", "qwen3", "llama")  # text_config.model_type (internvl/text.py)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class InternVLSpec(ModelSpec):
    vision: VisionSpec
    tiling: TilingConfig  # the checkpoint's own (preprocessor_config.json)

    @property
    def tokens_per_tile(self) -> int:
        return self.vision.tokens_per_tile(self.tiling.tile_size)


def _pair(v: int | list[int]) -> int:
    if isinstance(v, (list, tuple)):
        if v[0] != v[1]:
            raise ModelError(f"non-square image/patch size {v} is not supported")
        return int(v[0])
    return int(v)


def _text_spec(cfg: dict, t: dict, cfg_file: Path) -> TextSpec:
    where = f"{cfg_file}: text_config"
    kind = check_kind(t.get("model_type", "qwen2"), where, HF_TEXT_MODELS)
    tie = cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return text_spec(kind, t, bool(tie), where)


def _vision_spec(cfg: dict, v: dict, pre: dict, text_hidden: int) -> VisionSpec:
    return VisionSpec(
        hidden=v["hidden_size"], layers=v["num_hidden_layers"], heads=v["num_attention_heads"],
        intermediate=v["intermediate_size"], patch=_pair(v.get("patch_size", 14)),
        image_size=_pair(v.get("image_size", 448)), norm_type=v.get("norm_type", "layer_norm"),
        eps=float(v.get("layer_norm_eps", 1e-6)), qk_norm=bool(v.get("use_qk_norm", False)),
        act=v.get("hidden_act", "gelu"), mean_pooling=bool(v.get("use_mean_pooling", True)),
        feature_layer=int(cfg.get("vision_feature_layer", -1)),
        drop_cls=cfg.get("vision_feature_select_strategy", "default") == "default",
        downsample=float(cfg.get("downsample_ratio", 0.5)),
        projector_act=cfg.get("projector_hidden_act", "gelu"), text_hidden=text_hidden,
        mean=tuple(pre.get("image_mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
        std=tuple(pre.get("image_std", IMAGENET_STD)))  # type: ignore[arg-type]


class InternVL(ModelFamily):
    def read_spec(self, path: Path, config: dict) -> InternVLSpec:
        v, t = config["vision_config"], config["text_config"]
        text = _text_spec(config, t, path / "config.json")
        pre = read_json(path / "preprocessor_config.json")
        size = pre.get("size", {}).get("height") or _pair(v.get("image_size", 448))
        tiling = TilingConfig(tile_size=int(size), min_tiles=int(pre.get("min_patches", 1)),
                              max_tiles=int(pre.get("max_patches", 12)), use_thumbnail=True)
        return InternVLSpec(path, "internvl", text, int(config.get("image_token_id", 151667)),
                            _vision_spec(config, v, pre, text.hidden), tiling)

    def normalise_key(self, key: str) -> str:
        """Any accepted key spelling -> ``vision_tower.*``, ``multi_modal_projector.*``,
        ``language_model.*`` (decoder, no ``model.``) or ``lm_head.weight``."""
        if key.startswith("model."):
            key = key[len("model."):]
        if key.startswith("language_model.model."):
            key = "language_model." + key[len("language_model.model."):]
        if key == "language_model.lm_head.weight":
            key = "lm_head.weight"
        return key

    def build(self, spec: ModelSpec, weights: dict,
              path: Path) -> tuple[VisionEncoder, TextDecoder]:
        assert isinstance(spec, InternVLSpec)
        vision = VisionEncoder(spec.vision)
        load_weights(vision, weights, path)
        assert isinstance(spec.text, TextSpec)
        llm = TextDecoder(spec.text)
        load_weights(llm, weights, path)
        return vision, llm

    def load_tokenizer(self, path: Path) -> Any:
        tok = load_tokenizer(path)
        names = ("start_image_token", "context_image_token", "end_image_token")
        return check_tokenizer(tok, path, {a: getattr(tok, a, None) is not None and (
            tok.convert_tokens_to_ids(getattr(tok, a)) not in (None, tok.unk_token_id))
            for a in names}, "InternVL")

    def prompt_builder(self, tokenizer: Any, spec: ModelSpec) -> InternVLPrompts:
        assert isinstance(spec, InternVLSpec)
        return InternVLPrompts(tokenizer, spec.tokens_per_tile, spec.image_token_id)

    def image_plan(self, spec: ModelSpec, options: ImageOptions) -> TilingConfig:
        """The checkpoint's tiling with the run's mode, tile cap and token budget applied.

        A budget of B tiles (``max_image_tokens // tokens_per_tile``) caps the grid so that
        grid plus thumbnail fit: reference mode adds a thumbnail from 2 grid tiles, reduced
        from 3.
        """
        assert isinstance(spec, InternVLSpec)
        t = spec.tiling
        max_tiles = options.max_tiles or t.max_tiles
        if options.max_image_tokens is not None:
            budget = options.max_image_tokens // spec.tokens_per_tile
            if budget < 1:
                raise ValueError(f"max_image_tokens {options.max_image_tokens} is less than one "
                                 f"tile ({spec.tokens_per_tile} tokens)")
            thumb_from = 3 if options.tiling == "reduced" else 2
            max_tiles = min(max_tiles, budget if budget < thumb_from else budget - 1)
        # --resize reference: the original layout's model card resizes with Pillow, the HF
        # layout's processor (GotOcr2ImageProcessor) with torchvision (resize.py)
        kernel = "pillow" if spec.model_type == "internvl_chat" else "torchvision"
        return TilingConfig(t.tile_size, min(t.min_tiles, max_tiles), max_tiles, t.use_thumbnail,
                            mode=options.tiling, upscale_limit=options.upscale_limit,
                            resize=reference_kernel(options.resize, kernel))

    def vision_input_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        assert isinstance(spec, InternVLSpec)
        return (spec.tiling.tile_size, spec.tiling.tile_size, 3)

    def vision_output_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        assert isinstance(spec, InternVLSpec)
        return (spec.tokens_per_tile, spec.text.hidden)


INTERNVL = InternVL()  # the family object models/registry.py names "internvl"
