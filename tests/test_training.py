"""The built-in model's training step (scripts/train_default_model.py).

Two properties the committed model's recipe rests on: length bucketing (the fast path) gives
the same losses as one padded batch, and the match loss supervises each shape/colour word of
a question with whether the image has that attribute.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from scripts.train_default_model import AUX, TILING, Batcher, model_config, scene_target, train_step
from vlmbatch.cli.bench.shapes import make_questions, make_scene
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.preprocessing.prepare import prepare


@pytest.fixture(scope="module")
def setup():  # noqa: ANN201
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    torch.manual_seed(0)
    cfg = model_config(len(tok), tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
                       tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    model = InternVLForConditionalGeneration(cfg).eval()
    match = torch.nn.Linear(cfg.text_config.hidden_size, 1)
    aux_head = torch.nn.Linear(cfg.vision_config.hidden_size, len(AUX))
    return tok, model, Batcher(tok, cfg.image_seq_length), match, aux_head


def scene_items(n: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        scene = make_scene(rng)
        items.append((prepare(scene.image, TILING).tiles, make_questions(scene, rng, 4),
                      scene_target(scene), np.ones(len(AUX), np.float32)))
    return items


def test_every_attribute_word_is_one_token(setup) -> None:  # noqa: ANN001
    _, _, batcher, _, _ = setup
    assert sorted(batcher.attribute.values()) == list(range(len(AUX)))


def test_length_buckets_give_the_same_losses(setup) -> None:  # noqa: ANN001
    _, model, batcher, match, aux_head = setup
    items = scene_items(5, seed=1)  # 20 questions: buckets of 7, 7 and 6
    assert len({len(t) for t, *_ in items}) > 1  # several tile counts -> several lengths
    t, qa, target, mask = items[0]  # an open answer of several tokens: uneven label counts
    items[0] = (t, [("what is the colour of the shape?", "dark teal and gray")] + qa[:3],
                target, mask)
    with torch.no_grad():
        one = train_step(model, aux_head, batcher, items, 4, random.Random(3), match, 2, 1)
        three = train_step(model, aux_head, batcher, items, 4, random.Random(3), match, 2, 3)
    for a, b in zip(one, three):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_match_loss_targets_each_attribute_word(setup) -> None:  # noqa: ANN001
    """With a match head that outputs a constant logit c, the match loss is the mean of
    BCE(c, target) over the attribute words of the questions, so it reveals the targets."""
    _, model, batcher, _, aux_head = setup
    tiles = scene_items(1, seed=2)[0][0]
    target = np.zeros(len(AUX), np.float32)
    target[AUX.index("red")] = target[AUX.index("circle")] = 1
    qa = [("is there a red triangle?", "no")]  # red: present (1), triangle: absent (0)
    const = torch.nn.Linear(model.config.text_config.hidden_size, 1)
    torch.nn.init.zeros_(const.weight)
    torch.nn.init.constant_(const.bias, 2.0)
    item = (tiles, qa, target, np.ones(len(AUX), np.float32))
    with torch.no_grad():
        _, _, got = train_step(model, aux_head, batcher, [item], 1, random.Random(0), const, 2)
    c = torch.tensor(2.0)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    want = (bce(c, torch.tensor(1.0)) + bce(c, torch.tensor(0.0))) / 2
    torch.testing.assert_close(got, want)
    # and a masked-out attribute does not count
    mask = np.ones(len(AUX), np.float32)
    mask[AUX.index("triangle")] = 0
    with torch.no_grad():
        _, _, got = train_step(model, aux_head, batcher, [(tiles, qa, target, mask)], 1,
                               random.Random(0), const, 2)
    torch.testing.assert_close(got, bce(c, torch.tensor(1.0)))
