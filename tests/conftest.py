"""Shared fixtures: small random-weight InternVL checkpoints built and saved by the tests.

Nothing is downloaded: the config is written here, weights are random (seeded), and the
tokenizer is our own byte-level BPE trained on a few sentences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.tokenizer import build_tokenizer

CORPUS = ["is there a red shape?", "does the image contain a circle?", "yes", "no", "Yes", "No",
          "<|im_start|>user\n", "<|im_start|>assistant\n", "what color is the triangle?"] * 20


def make_model_dir(path: Path, *, tile: int = 56, patch: int = 14, vision_layers: int = 2,
                   norm_type: str = "layer_norm", qk_norm: bool = False,
                   mean_pooling: bool = True, max_tiles: int = 6, seed: int = 0) -> Path:
    """Save a random InternVL (HF-native) with our tokenizer into ``path``; returns it."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tok = build_tokenizer(CORPUS, vocab_size=300)
    cfg = InternVLConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=vision_layers, num_attention_heads=2,
                           intermediate_size=64, image_size=tile, patch_size=patch,
                           norm_type=norm_type, use_qk_norm=qk_norm,
                           use_mean_pooling=mean_pooling, layer_scale_init_value=0.5),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=(tile // patch) ** 2 // 4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF zero-inits these; random values make the test stronger
        for name, p in model.named_parameters():
            if "position_embeddings" in name or "cls_token" in name:
                p.normal_(0, 0.5)
            elif "lambda" in name:
                p.uniform_(0.5, 1.5)
            elif "norm" in name and "bias" in name:
                p.normal_(0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True,
        "min_patches": 1, "max_patches": max_tiles, "size": {"height": tile, "width": tile},
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    return path


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("internvl_random"))


def reference_pixels(tiles: torch.Tensor, mean=(0.485, 0.456, 0.406),  # noqa: ANN001
                     std=(0.229, 0.224, 0.225)) -> torch.Tensor:
    """uint8 [N,S,S,3] -> normalised [N,3,S,S] the way InternVL's model card does it
    (ToTensor: /255, then Normalize)."""
    x = tiles.permute(0, 3, 1, 2).float() / 255.0
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
