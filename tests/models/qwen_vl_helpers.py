"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoints built by the tests (no
download).

Sizes are picked so that every code path is exercised with few weights: the decoder's head
dim 16 gives 8 rotary pairs split (2, 3, 3) over t/h/w; Qwen2.5-VL's 56 px windows are 2x2
merge units, so every grid used has several windows and a ragged edge; Qwen3-VL's learned
position table is 4x4 (resampled to every grid) and DeepStack feeds 2 of 3 decoder layers.
Qwen3.5: five decoder layers, linear-full-linear-linear-full (the first layer linear, two
full ones, so the KV pool's layers are not the decoder's), q/k/v/o biases
(``attention_bias``), head dim 32 with a quarter rotary (8 channels, 4 pairs split (2, 1, 1)),
Gated DeltaNet with 2 key heads serving 4 value heads of unequal key/value dims (8, 12), and
up to 80 image tokens, so prompts span several chunks of the chunked rule.
Weights are drawn with a larger spread than transformers' default (0.02) so that logits are
O(1) and a wrong position, mask or window changes them far above the tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from vlmbatch.models.qwen_vl.random import (
    CLASSES,
    preprocessor_config,
    random_model,
    save_random_colqwen2,
    save_random_qwen_vl,
)

KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
VOCAB = 320
IMAGE, VIDEO, START, END, EOS = 310, 311, 312, 313, 314
# preprocessor_config.json of the test checkpoints: small pixel budgets, so grids stay small
PIXELS = {"qwen2_vl": (56 * 56, 28 * 28 * 40), "qwen2_5_vl": (56 * 56, 28 * 28 * 40),
          "qwen3_vl": (64 * 64, 32 * 32 * 40), "qwen3_5": (64 * 64, 32 * 32 * 80)}


def text_kwargs(kind: str) -> dict:
    """The tiny decoder's text_config keywords (no vocabulary or special ids)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    t = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rope_parameters=rope)
    if kind == "qwen3_vl":
        rope["mrope_interleaved"] = True
        t["head_dim"] = 16
    if kind == "qwen3_5":
        rope.update(mrope_interleaved=True, partial_rotary_factor=0.25, mrope_section=[2, 1, 1])
        t.update(num_hidden_layers=5, head_dim=32, attention_bias=True,
                 layer_types=["linear_attention", "full_attention", "linear_attention",
                              "linear_attention", "full_attention"],
                 linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=12)
    return t


def vision_kwargs(kind: str) -> dict:
    """The tiny tower's vision_config keywords."""
    v = dict(depth=3, num_heads=2)
    if kind == "qwen2_vl":
        return dict(v, embed_dim=32, hidden_size=64, mlp_ratio=2)
    if kind == "qwen2_5_vl":
        return dict(v, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=56,
                    fullatt_block_indexes=[1], tokens_per_second=3)  # not the default 2 or 4
    if kind == "qwen3_5":  # Qwen3-VL's tower without DeepStack
        return dict(v, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                    num_position_embeddings=16)
    return dict(v, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                num_position_embeddings=16, deepstack_visual_indexes=[0, 2])


def config(kind: str) -> PreTrainedConfig:
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END)
    text = dict(text_kwargs(kind), vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS,
                pad_token_id=0, initializer_range=0.1)
    return CLASSES[kind][0](vision_config=dict(vision_kwargs(kind), initializer_range=0.1),
                            text_config=text, **ids)


def reference_model(kind: str, seed: int = 0) -> torch.nn.Module:
    return random_model(config(kind), seed)


def save_engine_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """The tiny model with our tokenizer (``models/qwen_vl/random.py``): what ``vlmbatch``
    loads end to end."""
    return save_random_qwen_vl(path, kind, vision=vision_kwargs(kind), text=text_kwargs(kind),
                               pixels=PIXELS[kind], seed=seed, initializer_range=0.1)


def save_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """``save_pretrained`` of a tiny random model + a preprocessor config; returns ``path``."""
    reference_model(kind, seed).save_pretrained(path)
    patch = 16 if kind in ("qwen3_vl", "qwen3_5") else 14
    (path / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(kind, patch, 2, PIXELS[kind])))
    return path


def reference_pixels(patches: torch.Tensor, mean: tuple[float, ...],
                     std: tuple[float, ...]) -> torch.Tensor:
    """uint8 patch rows [N, C*T*P*P] -> normalised float32 rows, as the image processor
    computes them (rescale by 1/255, then (x - mean) / std per channel)."""
    per = patches.shape[1] // 3
    m = torch.tensor(mean, dtype=torch.float32).repeat_interleave(per)
    s = torch.tensor(std, dtype=torch.float32).repeat_interleave(per)
    return (patches.float() * (1 / 255) - m) / s


def prompt_ids(n_before: int, n_image: int, n_after: int, seed: int = 0) -> list[int]:
    """Random text ids, then <|vision_start|> + n_image pads + <|vision_end|>, then text;
    ``n_before`` / ``n_after`` count the start / end tokens."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 300, (n_before + n_after,), generator=g).tolist()
    return (text[: n_before - 1] + [START] + [IMAGE] * n_image + [END]
            + text[n_before - 1: n_before + n_after - 2])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def save_colqwen2_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """The tiny ``kind`` model inside transformers' ``ColQwen2ForRetrieval`` (128-dim
    projection), with our tokenizer: a ``model_type: colqwen2`` checkpoint."""
    return save_random_colqwen2(path, kind, vision=vision_kwargs(kind), text=text_kwargs(kind),
                                pixels=PIXELS[kind], seed=seed, initializer_range=0.1)
