"""The committed built-in Qwen2.5-VL model (``vlmbatch/models/default_qwen_model``, trained by
``scripts/train_qwen_model.py``): an ordinary HF ``qwen2_5_vl`` checkpoint under 30 MB, served
by our Qwen-VL family (OpenCV smart resize, window-attention tower, M-RoPE decoder), and
accurate on the whole easy-vqa test split (7,136 yes/no questions it never trained on).
"""

from __future__ import annotations

import json

import vlmbatch
from vlmbatch.cli.evaluate import evaluate_easy_vqa
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.models.paths import DEFAULT_QWEN_MODEL

# The committed model measures 0.9983 (7,124 of 7,136 right: docs/models.md, `vlmbatch eval --model
# vlmbatch/models/default_qwen_model`); the floor is that figure less 2 questions (>= 7,122
# right). Issue 18's target was 0.99.
FLOOR = 0.998


def test_default_qwen_model_is_hf_qwen2_5_vl() -> None:
    cfg = json.loads((DEFAULT_QWEN_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl"
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    size = sum(p.stat().st_size for p in DEFAULT_QWEN_MODEL.glob("*.safetensors"))
    assert size <= 30 * 2**20
    assert vlmbatch.QWEN_MODEL == DEFAULT_QWEN_MODEL


def test_easy_vqa_test_accuracy() -> None:
    r = evaluate_easy_vqa(ModelConfig(path=DEFAULT_QWEN_MODEL), EngineConfig(), split="test",
                 progress=False)
    assert r.questions == 7136
    assert r.accuracy >= FLOOR, f"accuracy {r.accuracy:.4f} ({r.correct} right)"
