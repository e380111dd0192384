"""Qwen-VL config.json -> spec, in the layouts transformers 5 saves and the hub ships."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.models.conftest import Pair
from tests.models.qwen_vl_helpers import END, IMAGE, PIXELS, START
from vlmbatch.models.qwen_vl.spec import SpecError, read_qwen_vl_spec, spec_from_config

# Abridged from the hub's Qwen2-VL-2B-Instruct config.json: flat text settings, "mrope"
HUB_QWEN2_VL = {
    "model_type": "qwen2_vl", "hidden_size": 1536, "intermediate_size": 8960,
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "vocab_size": 151936, "use_sliding_window": False, "image_token_id": 151655,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                      "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
}
HUB_QWEN2_VL_PRE = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                    "temporal_patch_size": 2, "merge_size": 2,
                    "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711]}


def test_saved_config(pair: Pair) -> None:
    spec = read_qwen_vl_spec(pair.path)
    cfg = pair.ref.config
    v, t = cfg.vision_config, cfg.text_config
    assert spec.model_type == cfg.model_type
    assert (spec.image_token_id, spec.vision_start_id, spec.vision_end_id) == (IMAGE, START, END)
    assert spec.vision.depth == v.depth and spec.vision.heads == v.num_heads
    assert spec.vision.patch == v.patch_size and spec.vision.merge == v.spatial_merge_size
    assert spec.text.layers == t.num_hidden_layers and spec.text.kv_heads == 2
    qwen3_5 = cfg.model_type == "qwen3_5"
    assert spec.text.mrope_section == ((2, 1, 1) if qwen3_5 else (2, 3, 3))
    qwen3 = cfg.model_type in ("qwen3_vl", "qwen3_5")
    assert spec.text.rope == ("mrope-interleaved" if qwen3 else "mrope-sectioned")
    assert spec.text.qk_norm == qwen3
    assert spec.text.rope_dim == (8 if qwen3_5 else spec.text.head_dim)
    assert spec.text.attn_gate == spec.text.centered_norm == qwen3_5
    assert spec.text.kinds == (("linear", "full", "linear", "linear", "full") if qwen3_5
                               else ("full",) * t.num_hidden_layers)
    assert spec.vision.deepstack == ((0, 2) if cfg.model_type == "qwen3_vl" else ())
    pre = spec.preprocess
    assert (pre.min_pixels, pre.max_pixels) == PIXELS[cfg.model_type]
    assert pre.factor == (32 if qwen3 else 28)


def test_hub_layout_qwen2_vl(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HUB_QWEN2_VL))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB_QWEN2_VL_PRE))
    spec = read_qwen_vl_spec(tmp_path)
    assert spec.vision.hidden == 1280 and spec.vision.intermediate == 5120
    assert spec.vision.out_hidden == spec.text.hidden == 1536
    assert spec.vision.act == "quick_gelu"
    assert spec.text.head_dim == 128 and spec.text.rope_theta == 1e6
    assert spec.text.mrope_section == (16, 24, 24) and spec.text.tie_embeddings
    assert spec.text.qkv_bias and not spec.text.o_bias
    assert (spec.preprocess.min_pixels, spec.preprocess.max_pixels) == (3136, 12845056)


def test_refuses_moe_and_others() -> None:
    with pytest.raises(SpecError, match="qwen3_vl_moe.*not supported.*dense"):
        spec_from_config({"model_type": "qwen3_vl_moe"})
    with pytest.raises(SpecError, match="not a Qwen-VL model"):
        spec_from_config({"model_type": "internvl"})


def test_refuses_inconsistent_configs() -> None:
    bad = dict(HUB_QWEN2_VL, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 20]})
    with pytest.raises(SpecError, match="mrope_section"):
        spec_from_config(bad)
    with pytest.raises(SpecError, match="rope type 'yarn'"):
        spec_from_config(dict(HUB_QWEN2_VL, rope_scaling={"type": "yarn"}))
    with pytest.raises(SpecError, match="patch/merge/temporal"):
        spec_from_config(HUB_QWEN2_VL, dict(HUB_QWEN2_VL_PRE, patch_size=16))
    with pytest.raises(SpecError, match="sliding-window"):
        spec_from_config(dict(HUB_QWEN2_VL, use_sliding_window=True))
