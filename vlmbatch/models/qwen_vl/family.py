"""The Qwen-VL family: HF-native Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense)
checkpoints, registered as ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_5``
(``models/registry.py``); ``qwen3_vl_moe`` and ``qwen3_5_moe`` are refused there with the
reason (mixture-of-experts decoder layers are not implemented). Qwen3.5's decoder holds
Gated DeltaNet layers (``models/linear_attention.py``); its prompts ask the chat template for
no thinking (``enable_thinking=False``).

A model directory holds ``config.json`` (flat hub layout or transformers 5's nested
``text_config``, ``spec.py``), ``model.safetensors`` or a sharded index, the tokenizer files
(with ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``) and optionally
``preprocessor_config.json`` (patch/merge sizes, min/max pixels, mean/std). Qwen3.5's
multi-token-prediction weights (``mtp.*``) are not read (transformers ignores them too).
transformers reads only the tokenizer; the weights go from safetensors into
``vision.VisionTower`` and ``models.decoder.TextDecoder`` (M-RoPE spec).

Key layouts accepted, all normalised to ``visual.*``, ``language_model.*`` and
``lm_head.weight``: the hub's Qwen2/2.5-VL (``visual.*``, ``model.*``), transformers 5's
(``model.visual.*``, ``model.language_model.*``), and ``language_model.model.*``. Our decoder
parameter names are the checkpoint's without ``language_model.`` (``layers.0.self_attn.
q_proj.weight``), as for every family.

Embeddings (``docs/embeddings.md``): jina-embeddings-v4's layout and pooling for the three
kinds (``prompt.JINA``; default ``image-mean``); ``colqwen2`` checkpoints (transformers'
``ColQwen2ForRetrieval``: a Qwen2-VL or Qwen2.5-VL under ``vlm.``, no LM head, and an
``embedding_proj_layer``) are this family with ColQwen2's prompts (``prompt.COLQWEN2``) and
multi-vector output by default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmbatch.models.base import BudgetForward, ImageOptions, ModelFamily, ModelSpec
from vlmbatch.models.config_io import ModelError, read_json
from vlmbatch.models.decoder import TextDecoder, TextSpec
from vlmbatch.models.io import load_weights
from vlmbatch.models.qwen_vl.parts import video_rule
from vlmbatch.models.qwen_vl.prompt import COLQWEN2, JINA, EmbedTemplate, QwenVLPrompts
from vlmbatch.models.qwen_vl.spec import SpecError, VisionSpec, spec_from_config
from vlmbatch.models.qwen_vl.vision import VisionTower
from vlmbatch.models.qwen_vl.vision_static import budget_forward, budget_meta
from vlmbatch.models.tokenizer import check_tokenizer, load_tokenizer
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess
from vlmbatch.preprocessing.resize import reference_kernel

IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# checkpoint key prefix -> normal form, first match wins (module docstring)
_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model."),
             ("language_model.model.", "language_model."), ("language_model.lm_head.", "lm_head."),
             ("model.", "language_model."))


@dataclass(frozen=True)
class QwenVLModelSpec(ModelSpec):
    vision: VisionSpec
    preprocess: QwenVLPreprocess  # the checkpoint's own (preprocessor_config.json)
    vision_start_id: int
    vision_end_id: int
    video_token_id: int = 151656  # <|video_pad|>
    tokens_per_second: float = 4  # Qwen2.5-VL's video time positions (spec.py)


class QwenVL(ModelFamily):
    packed_vision = True
    embed_template: EmbedTemplate = JINA  # how embedding inputs are written (prompt.py)

    def read_spec(self, path: Path, config: dict) -> QwenVLModelSpec:
        try:
            s = spec_from_config(config, read_json(path / "preprocessor_config.json"))
        except (SpecError, KeyError) as e:  # KeyError: a size config.json lacks
            raise ModelError(f"{path / 'config.json'}: {e}") from e
        return QwenVLModelSpec(path, s.model_type, s.text, s.image_token_id, s.vision,
                               s.preprocess, s.vision_start_id, s.vision_end_id,
                               s.video_token_id, s.tokens_per_second)

    def normalise_key(self, key: str) -> str:
        for theirs, ours in _PREFIXES:
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        return key

    def build(self, spec: ModelSpec, weights: dict,
              path: Path) -> tuple[VisionTower, TextDecoder]:
        assert isinstance(spec, QwenVLModelSpec) and isinstance(spec.text, TextSpec)
        vision = VisionTower(spec.vision)
        load_weights(vision, weights, path)
        text = TextDecoder(spec.text)
        load_weights(text, weights, path)
        return vision, text

    def load_tokenizer(self, path: Path) -> Any:
        tok = load_tokenizer(path)
        return check_tokenizer(tok, path, {t: tok.convert_tokens_to_ids(t) not in (
            None, tok.unk_token_id) for t in IMAGE_TOKENS}, "Qwen-VL")

    def prompt_builder(self, tokenizer: Any, spec: ModelSpec) -> QwenVLPrompts:
        assert isinstance(spec, QwenVLModelSpec)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS]
        want = [spec.vision_start_id, spec.image_token_id, spec.vision_end_id]
        if ids != want:
            raise ModelError(f"{spec.path}: the tokenizer's {', '.join(IMAGE_TOKENS)} are ids "
                             f"{ids}, config.json says {want}; tokenizer and config must come "
                             "from the same checkpoint")
        chat = {"enable_thinking": False} if spec.model_type == "qwen3_5" else None
        rule = video_rule(spec.model_type, spec.video_token_id, spec.vision.temporal,
                          spec.tokens_per_second)
        return QwenVLPrompts(tokenizer, spec.image_token_id, spec.vision_start_id,
                             spec.vision_end_id, spec.vision.merge, self.embed_template, chat,
                             rule)

    def image_plan(self, spec: ModelSpec, options: ImageOptions) -> QwenVLPreprocess:
        """The checkpoint's smart resize, with ``--max-image-tokens`` lowering max_pixels.
        Tiling options do not apply (no tiles): ``--max-tiles`` is an error."""
        assert isinstance(spec, QwenVLModelSpec)
        if options.max_tiles is not None:
            raise ValueError("--max-tiles applies to tiled models (InternVL); Qwen-VL resizes "
                             "whole images: cap them with --max-image-tokens")
        # --resize reference: Qwen2VLImageProcessor's torchvision bicubic (resize.py)
        kernel = reference_kernel(options.resize, "torchvision")
        plan = dataclasses.replace(spec.preprocess, resize=kernel)
        return plan if options.max_image_tokens is None else plan.with_max_tokens(
            options.max_image_tokens)

    def budget_forward(self, spec: ModelSpec) -> BudgetForward:
        """``vision_static.py``: the tower on budget-padded rows, a merge unit per token."""
        assert isinstance(spec, QwenVLModelSpec)
        unit = spec.vision.merge ** 2
        return BudgetForward(budget_meta, budget_forward, unit, unit)

    def vision_input_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        assert isinstance(spec, QwenVLModelSpec)
        return (spec.vision.row_size,)

    def vision_output_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        return (spec.text.hidden,)


class ColQwen2(QwenVL):
    """``model_type: colqwen2``: the inner ``vlm_config`` (Qwen2-VL or Qwen2.5-VL) read as
    that kind, weights under ``vlm.``; the checkpoint has no LM head (``ColQwen2ForRetrieval``
    keeps the base model only), so the decoder's head is tied to its token embeddings: it
    serves no answer (an embedding checkpoint is refused by ``run``), only the shapes."""
    embed_template = COLQWEN2
    multi_vector_default = True

    def read_spec(self, path: Path, config: dict) -> QwenVLModelSpec:
        inner = config.get("vlm_config")
        kind = inner.get("model_type") if isinstance(inner, dict) else None
        if kind not in ("qwen2_vl", "qwen2_5_vl"):
            raise ModelError(f"{path / 'config.json'}: a colqwen2 checkpoint's vlm_config must "
                             f"be a Qwen2-VL or Qwen2.5-VL config (model_type 'qwen2_vl' or "
                             f"'qwen2_5_vl'), got {kind!r}")
        assert isinstance(inner, dict)
        spec = super().read_spec(path, inner)
        assert isinstance(spec.text, TextSpec)
        return dataclasses.replace(spec, text=dataclasses.replace(spec.text,
                                                                  tie_embeddings=True))

    def normalise_key(self, key: str) -> str:
        return super().normalise_key(key[len("vlm."):] if key.startswith("vlm.") else key)


# the family objects models/registry.py names (one for every kind of spec.KINDS)
QWEN_VL = QwenVL()
COLQWEN2_FAMILY = ColQwen2()
