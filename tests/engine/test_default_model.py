"""The committed built-in model: loads, is the real architecture, and is accurate.

The accuracy floor is checked on the whole easy-vqa test split (7,136 yes/no questions; the
model never trained on it). It runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import json

import pytest

from vlmbatch.cli.evaluate import evaluate_easy_vqa
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.models.paths import DEFAULT_MODEL

# The committed model measures 0.9985 (7,125 of 7,136 right: docs/models.md, `vlmbatch eval`); the
# floor is that figure less 3 questions (>= 7,122 right), so a change that costs the model a
# handful of answers fails here (issue 2 asked for >= 0.95; 0.99 let 60 answers go).
FLOOR = 0.998
# `vlmbatch eval --open` (docs/models.md) measures 0.9976 (2,531 of 2,537 right); the floor is the
# issue's target, 0.95, raised to 0.99: 2 wrong in the first 200, 25 in all
OPEN_FLOOR = 0.99


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
    r = evaluate_easy_vqa(ModelConfig(), EngineConfig(), split="test", progress=False)
    assert r.questions == 7136
    assert r.accuracy >= FLOOR, f"accuracy {r.accuracy:.4f} ({r.correct} right)"


def test_easy_vqa_open_questions_are_label_sets() -> None:
    """``eval --open``'s set: easy-vqa's 2,537 open test questions, each asked over the 3
    shapes or the 8 colours, the expected answer among its choices."""
    from vlmbatch.cli.embed_eval import COLOURS, SHAPES
    from vlmbatch.cli.evaluate import easy_vqa_set

    data = easy_vqa_set("test", open_questions=True)
    qs = {(it.id, q.id): q for it in data.items for q in it.questions}
    assert len(qs) == len(data.expected) == 2537
    for key, want in data.expected.items():
        assert qs[key].choices == (COLOURS if want in COLOURS else SHAPES), (qs[key], want)


@pytest.mark.parametrize("limit", [pytest.param(200), pytest.param(None, marks=pytest.mark.slow)])
def test_easy_vqa_open_accuracy(limit: int | None) -> None:
    """``vlmbatch eval --open`` (label sets, exact scoring): docs/models.md's figure is
    0.9976 on all 2,537; the floor is OPEN_FLOOR (the first 200 in CI, all with
    --run-slow)."""
    r = evaluate_easy_vqa(ModelConfig(), EngineConfig(), split="test", limit=limit, progress=False,
                 open_questions=True)
    assert r.questions == (limit or 2537)
    assert r.accuracy >= OPEN_FLOOR, f"accuracy {r.accuracy:.4f} ({r.correct} right)"


def test_answers_agree_with_pillow_reference_preprocessing() -> None:
    """Issue 3's parity bar: the built-in model answers the same with our OpenCV path and
    with InternVL's Pillow reference preprocessing on >= 99% of easy-vqa test questions
    (first 300 images here, about 2,100 questions)."""
    from pathlib import Path

    import numpy as np

    from vlmbatch.engine.records import Request
    from vlmbatch.engine.torch_engine import TorchEngine
    from vlmbatch.preprocessing.decode import decode
    from vlmbatch.preprocessing.prepare import PreparedImage, content_hash, prepare
    from vlmbatch.preprocessing.reference import pillow_tiles

    m = load_model()
    engine = TorchEngine(m, EngineConfig(prefix_cache=False))
    t = m.spec.tiling
    items = evaluate_items()[:300]
    agree = total = 0
    for k in range(0, len(items), 50):
        group = items[k: k + 50]
        ours, ref, reqs = [], [], []
        for i, it in enumerate(group):
            data = Path(it.image).read_bytes()
            p = prepare(decode(data), t)
            tiles = np.stack([np.asarray(x) for x in pillow_tiles(data, t.tile_size,
                                                                  t.min_tiles, t.max_tiles)])
            ours.append(p)
            ref.append(PreparedImage(tiles, p.grid, content_hash(tiles), p.width, p.height))
            reqs += [Request(i, q.text) for q in it.questions]
        a = engine.score(ours, reqs)
        b = engine.score(ref, reqs)
        agree += sum((x.p_yes >= 0.5) == (y.p_yes >= 0.5) for x, y in zip(a, b))
        total += len(reqs)
    assert total > 2000 and agree / total >= 0.99, f"{agree}/{total}"


def evaluate_items():  # noqa: ANN201
    from vlmbatch.cli.evaluate import easy_vqa_items

    return easy_vqa_items("test")
