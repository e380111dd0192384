"""Random-weight InternVL checkpoints (HF-native layout) for tests and benchmarks.

``save_random_internvl`` writes what ``engine.loading.load_model`` and transformers'
``InternVLForConditionalGeneration`` both read: config, safetensors weights (seeded), our own
byte-level BPE tokenizer (``models/internvl/tokenizer.py``) and a preprocessor config. Nothing is
downloaded.

Weights: transformers' initialisation with ``initializer_range`` as given (the tests use 0.1,
so logits are O(1)), then every parameter transformers leaves at a constant moved off it
(``perturb``): each 1-D parameter (Linear and conv biases, norm weights and biases) by
``spread`` * N(0, 1), the layer scales drawn from U(0.5, 1.5), the class token and position
embeddings from N(0, 0.5). With transformers' zero biases a decoder that dropped its q/k/v
biases passed every reference test; released Qwen2 decoders have large ones
(``tests/models/test_internvl_reference.py`` injects that fault and sees it caught).

The tests use tiny shapes (tests/conftest.py); ``SHAPES`` holds the shapes of
InternVL3-1B (InternViT-300M, 448 px tiles, 256 tokens per tile, Qwen2-0.5B), -2B and -8B
(Qwen2.5-1.5B and -7B decoders), for measuring speed at real size (``bench/qpm.py
--random-shape internvl3-1b``; an 8B random model is ~16 GB in bf16). Its answers mean nothing,
and its vocabulary is the tokenizer's few hundred tokens rather than Qwen2's 151,655 (the LM
head runs at one position per question, so this changes little).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import InternVLConfig, InternVLForConditionalGeneration, PreTrainedTokenizerBase

from vlmbatch.models.internvl.tokenizer import build_tokenizer

CORPUS = ["is there a red shape?", "does the image contain a circle?", "yes", "no", "Yes", "No",
          "<|im_start|>user\n", "<|im_start|>assistant\n", "what color is the triangle?"] * 20

# vision_config / text_config keywords of InternVL3-1B's config.json
INTERNVL3_1B = dict(
    tile=448, patch=14, max_tiles=12,
    vision=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                intermediate_size=4096, norm_type="layer_norm", use_qk_norm=False,
                use_mean_pooling=True, layer_scale_init_value=0.1),
    text=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
)


# Qwen2.5-1.5B / Qwen2.5-7B decoders of InternVL3-2B / -8B (from the published configs, as
# remembered: not read from a downloaded file); the vision tower is InternViT-300M in all three
_QWEN25_1P5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
_QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
INTERNVL3_2B = {**INTERNVL3_1B, "text": _QWEN25_1P5B}
INTERNVL3_8B = {**INTERNVL3_1B, "text": _QWEN25_7B}
SHAPES = {"internvl3-1b": INTERNVL3_1B, "internvl3-2b": INTERNVL3_2B,
          "internvl3-8b": INTERNVL3_8B}


def perturb(model: nn.Module, spread: float) -> None:
    """Move every parameter that transformers initialises to a constant (module docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "position_embeddings" in name or "cls_token" in name:
                p.normal_(0, 0.5)
            elif "lambda" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 1:
                p.add_(spread * torch.randn_like(p))


def save_random_internvl(path: Path, *, vision: dict, text: dict, tile: int, patch: int,
                         max_tiles: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                         vocab_size: int = 300, initializer_range: float = 0.02,
                         spread: float = 0.1, tokenizer: PreTrainedTokenizerBase | None = None
                         ) -> Path:
    """Save a seeded random InternVL with ``vision``/``text`` config keywords into ``path``
    (weights: module docstring); ``tokenizer``: one with ``<IMG_CONTEXT>`` instead of ours
    (the tests' ``tests/models/random_original.py`` ``save_sentencepiece_tokenizer``'s)."""
    tok = tokenizer or build_tokenizer(CORPUS, vocab_size=vocab_size)
    cfg = InternVLConfig(
        vision_config=dict(image_size=tile, patch_size=patch,
                           initializer_range=initializer_range, **vision),
        text_config={"model_type": "qwen2", "vocab_size": len(tok),
                     "tie_word_embeddings": True, "pad_token_id": tok.pad_token_id,
                     "initializer_range": initializer_range, **text},
        image_token_id=int(tok.convert_tokens_to_ids("<IMG_CONTEXT>")),  # type: ignore[arg-type]
        image_seq_length=(tile // patch) ** 2 // 4,
        tie_word_embeddings=text.get("tie_word_embeddings", True),
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    perturb(model, spread)
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True,
        "min_patches": 1, "max_patches": max_tiles, "size": {"height": tile, "width": tile},
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    return path
