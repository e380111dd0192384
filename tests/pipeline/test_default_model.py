"""The committed built-in model: loads, is the real architecture, and is accurate.

The accuracy floor is checked on the whole easy-vqa test split (7,136 yes/no questions; the
model never trained on it). It runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import json

from pipeline.config import EngineConfig, ModelConfig
from pipeline.evaluate import evaluate
from pipeline.model import DEFAULT_MODEL, load_model


def test_default_model_is_hf_internvl() -> None:
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "internvl"
    assert cfg["architectures"] == ["InternVLForConditionalGeneration"]
    assert cfg["text_config"]["model_type"] == "qwen2"
    size = sum(p.stat().st_size for p in DEFAULT_MODEL.glob("*.safetensors"))
    assert size <= 30 * 2**20
    m = load_model()
    assert m.spec.tokens_per_tile == 16 and m.spec.tiling.tile_size == 112
    for tok in ("<img>", "</img>", "<IMG_CONTEXT>"):
        assert m.tokenizer.convert_tokens_to_ids(tok) != m.tokenizer.unk_token_id


def test_easy_vqa_test_accuracy() -> None:
    r = evaluate(ModelConfig(), EngineConfig(), split="test", progress=False)
    assert r.questions == 7136
    assert r.accuracy >= 0.95, f"accuracy {r.accuracy:.4f}"
