"""Random-weight Qwen-VL checkpoints (HF-native layout) for tests and benchmarks.

``save_random_qwen_vl`` writes what ``engine.loading.load_model`` and transformers'
``Qwen2VL`` / ``Qwen2_5_VL`` / ``Qwen3VL`` / ``Qwen3_5ForConditionalGeneration`` all read:
config, seeded safetensors weights, our own byte-level BPE tokenizer with Qwen's special
tokens and chat template (``tokenizer.py``) and a preprocessor config. Nothing is downloaded.

Weights: transformers' initialisation with ``initializer_range`` as given (the tests use 0.1,
so logits are O(1)), and every 1-D parameter (norm weights, biases) moved by 0.1 * N(0, 1),
so that a wrong norm, bias or mask shows far above the tolerances. Qwen3.5's linear layers get
slow decays (``A_log`` drawn so that ``A`` is in [0.005, 0.1]: a state keeps most of what it
read tens of tokens back): transformers' ``A`` in [0.01, 16] forgets most heads' state within
a token or two, so a bug in carrying a state across a cached prefix would barely move the
answer.

``SHAPES`` are the sizes of two released checkpoints, for measuring speed at real size
(``bench/qpm.py --random-shape``); their answers mean nothing, and the vocabulary is the
tokenizer's few hundred tokens rather than Qwen's 151,936 (the LM head runs at one position
per question, so this changes little). **They were written from our knowledge of the
published config.json files of Qwen2.5-VL-3B-Instruct and Qwen3-VL-2B-Instruct, not read
from a downloaded file** (no model hub is reachable here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import (
    ColQwen2Config,
    ColQwen2ForRetrieval,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from vlmbatch.models.qwen_vl.spec import CLIP_MEAN, CLIP_STD
from vlmbatch.models.qwen_vl.tokenizer import build_tokenizer

CLASSES: dict[str, tuple[type, type]] = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
}
CORPUS = ["is there a red shape?", "does the image contain a circle?", "yes", "no", "Yes", "No",
          "<|im_start|>user\n", "<|im_start|>assistant\n", "what color is the triangle?"] * 20

# vision_config / text_config keywords and pixel range (preprocessor_config.json) of two
# released checkpoints, from our knowledge of their configs (module docstring)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": dict(
        kind="qwen2_5_vl", pixels=(56 * 56, 28 * 28 * 16384),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=112, hidden_act="silu",
                    fullatt_block_indexes=[7, 15, 23, 31]),
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                   "mrope_section": [16, 24, 24]})),
    "qwen3-vl-2b": dict(
        kind="qwen3_vl", pixels=(65536, 16777216),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                    out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
                    temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True})),
}


def random_model(config: PreTrainedConfig, seed: int = 0) -> PreTrainedModel:
    """transformers' model of ``config`` (a Qwen-VL config), seeded, 1-D parameters moved
    away from 1 and 0 (module docstring); eval mode."""
    torch.manual_seed(seed)
    model = CLASSES[config.model_type][1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.A_log"):  # slow decays (module docstring)
                p.uniform_(math.log(0.005), math.log(0.1))
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def preprocessor_config(kind: str, patch: int, merge: int, pixels: tuple[int, int]) -> dict:
    """``preprocessor_config.json`` as the released checkpoints write it (both spellings of
    the pixel range: ``size`` and ``min_pixels``/``max_pixels``)."""
    qwen3 = kind in ("qwen3_vl", "qwen3_5")
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch,
            "merge_size": merge, "temporal_patch_size": 2,
            "size": {"shortest_edge": pixels[0], "longest_edge": pixels[1]},
            "min_pixels": pixels[0], "max_pixels": pixels[1],
            "image_mean": [0.5] * 3 if qwen3 else list(CLIP_MEAN),
            "image_std": [0.5] * 3 if qwen3 else list(CLIP_STD)}


def save_random_qwen_vl(path: Path, kind: str, *, vision: dict, text: dict,
                        pixels: tuple[int, int], seed: int = 0,
                        dtype: torch.dtype = torch.float32, vocab_size: int = 300,
                        initializer_range: float = 0.02) -> Path:
    """Save a seeded random ``kind`` model with ``vision``/``text`` config keywords, our
    tokenizer and a preprocessor config for ``pixels`` (min, max) into ``path``."""
    tok = build_tokenizer(CORPUS, vocab_size=vocab_size)
    cfg = _config(kind, tok, vision, text, initializer_range)
    return _save(random_model(cfg, seed), tok, path, kind, vision, pixels, dtype)


def save_random_colqwen2(path: Path, kind: str, *, vision: dict, text: dict,
                         pixels: tuple[int, int], seed: int = 0, embedding_dim: int = 128,
                         vocab_size: int = 300, initializer_range: float = 0.02) -> Path:
    """As ``save_random_qwen_vl``, but transformers' ``ColQwen2ForRetrieval`` around a random
    ``kind`` (``qwen2_vl`` or ``qwen2_5_vl``) model: ``model_type: colqwen2``, the inner
    config as ``vlm_config``, weights under ``vlm.``, an ``embedding_proj_layer`` Linear to
    ``embedding_dim``, no LM head."""
    tok = build_tokenizer(CORPUS, vocab_size=vocab_size)
    inner = _config(kind, tok, vision, text, initializer_range)
    cfg = ColQwen2Config(vlm_config=inner.to_dict(), embedding_dim=embedding_dim,
                         initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = ColQwen2ForRetrieval(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return _save(model, tok, path, kind, vision, pixels, torch.float32)


def _config(kind: str, tok: Any, vision: dict, text: dict,
            initializer_range: float) -> PreTrainedConfig:
    """The ``kind`` config with the tokenizer's vocabulary and special ids."""
    ids = {name: int(tok.convert_tokens_to_ids(t)) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    eos = int(tok.convert_tokens_to_ids("<|im_end|>"))
    text = dict(text, vocab_size=len(tok), eos_token_id=eos, bos_token_id=None,
                pad_token_id=tok.pad_token_id, initializer_range=initializer_range)
    vision = dict(vision, initializer_range=initializer_range)
    return CLASSES[kind][0](vision_config=vision, text_config=text, **ids)


def _save(model: PreTrainedModel, tok: Any, path: Path, kind: str, vision: dict,
          pixels: tuple[int, int], dtype: torch.dtype) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(path)
    tok.save_pretrained(path)
    patch = int(vision.get("patch_size", 16 if kind in ("qwen3_vl", "qwen3_5") else 14))
    merge = int(vision.get("spatial_merge_size", 2))
    (path / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(kind, patch, merge, pixels), indent=2))
    return path
