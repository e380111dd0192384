"""The Qwen-VL built-in model's training (scripts/train_qwen_model.py): our modules trained,
written back into transformers' layout exactly; the step's losses bucketed or not are the
same; what it saves is a checkpoint ``vlmbatch`` serves, equal to transformers on it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts.train_default_model import AUX, scene_target
from scripts.train_qwen_model import (
    PRE,
    Batcher,
    Model,
    corpus,
    model_config,
    save,
    train_step,
)
from vlmbatch.cli.bench.shapes import make_questions, make_scene
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def setup():  # noqa: ANN201
    from transformers import Qwen2_5_VLForConditionalGeneration

    from vlmbatch.models.qwen_vl.tokenizer import build_tokenizer

    rng = np.random.default_rng(0)
    items = []
    for _ in range(4):
        scene = make_scene(rng)
        im = PRE.prepare(scene.image)
        items.append((im.rows, make_questions(scene, rng, 4), scene_target(scene),
                      np.ones(len(AUX), np.float32), im.grid.dims))
    tok = build_tokenizer(corpus(items), vocab_size=400)
    torch.manual_seed(0)
    model = Model(Qwen2_5_VLForConditionalGeneration(model_config(tok)).eval())
    match = torch.nn.Linear(model.spec.text.hidden, 1)
    aux_head = torch.nn.Linear(model.spec.text.hidden, len(AUX))
    return tok, model, Batcher(tok, model.config), match, aux_head, items


def test_weights_go_back_to_transformers_exactly(setup) -> None:  # noqa: ANN001
    _, model, *_ = setup
    before = {k: v.clone() for k, v in model.hf[0].state_dict().items()}
    with torch.no_grad():
        model.text.norm.weight.add_(1.0)  # a trained change must reach the HF model
        after = model.to_hf().state_dict()
        model.text.norm.weight.sub_(1.0)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["model.language_model.norm.weight"]
    assert all(torch.equal(before[k], v) for k, v in model.to_hf().state_dict().items())


def test_length_buckets_give_the_same_losses(setup) -> None:  # noqa: ANN001
    _, model, batcher, match, aux_head, items = setup
    with torch.no_grad():
        one = train_step(model, aux_head, batcher, items, 4, random.Random(3), match, 2, 1)
        three = train_step(model, aux_head, batcher, items, 4, random.Random(3), match, 2, 3)
    for a, b in zip(one, three):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(x) for x in one)


def test_what_it_saves_is_served_as_transformers_scores_it(setup, tmp_path: Path) -> None:  # noqa: ANN001
    from transformers import AutoModelForImageTextToText

    tok, model, *_, items = setup
    save(model, tok, tmp_path)
    ours = load_model(tmp_path)
    assert ours.spec.model_type == "qwen2_5_vl"
    ref = AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
    im = PRE.prepare(make_scene(np.random.default_rng(9)).image)
    engine = TorchEngine(ours, EngineConfig())
    (score,) = engine.score([im], [Request(0, "is there a red circle?")])
    ids = torch.tensor([ours.prompts.build("is there a red circle?", im).ids])
    x = torch.from_numpy(im.rows).float() / 255
    per = x.shape[1] // 3
    mean = torch.tensor(ours.spec.vision.mean).repeat_interleave(per)  # type: ignore[attr-defined]
    std = torch.tensor(ours.spec.vision.std).repeat_interleave(per)  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = ref(input_ids=ids, mm_token_type_ids=(ids == ours.spec.image_token_id).int(),
                     pixel_values=(x - mean) / std,
                     image_grid_thw=torch.tensor([im.grid.dims])).logits[0, -1]
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    assert abs(score.margin - float(logits[yes].logsumexp(-1) - logits[no].logsumexp(-1))) \
        <= 1e-4
