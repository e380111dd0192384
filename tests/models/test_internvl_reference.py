"""End to end against transformers: same image and prompt -> same logits (fp32, <= 1e-4).

The reference side is ``InternVLForConditionalGeneration.forward(input_ids, pixel_values)`` with
pixel values normalised the model-card way and the prompt expanded the way transformers'
``InternVLProcessor`` does (``<img>`` + N x ``<IMG_CONTEXT>`` + ``</img>``, then tokenized).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import InternVLForConditionalGeneration

from tests.conftest import reference_pixels
from vlmbatch.pipeline.config import EngineConfig
from vlmbatch.pipeline.loading import load_model
from vlmbatch.pipeline.records import Request
from vlmbatch.pipeline.torch_engine import TorchEngine
from vlmbatch.preprocessing.prepare import prepare

SIZES = [(56, 56), (112, 56), (200, 90), (30, 170), (300, 200)]  # (width, height)
QUESTIONS = ["is there a red shape?", "Does the image contain a circle?"]


@pytest.fixture(scope="module")
def models(random_model_dir):  # noqa: ANN001, ANN201
    ours = load_model(random_model_dir)
    ref = InternVLForConditionalGeneration.from_pretrained(str(random_model_dir)).eval()
    return ours, ref


def reference_ids(tok, question: str, n_tokens: int) -> list[int]:  # noqa: ANN001
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    expanded = text.replace("<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * n_tokens + "</img>")
    return tok(expanded, add_special_tokens=False)["input_ids"]


def test_prompt_matches_processor_expansion(models) -> None:  # noqa: ANN001
    ours, _ = models
    for n_tiles in (1, 3, 7):
        p = ours.prompts.build_for_tiles(QUESTIONS[1], n_tiles)
        assert list(p.ids) == reference_ids(ours.tokenizer, QUESTIONS[1],
                                             n_tiles * ours.spec.tokens_per_tile)
        span = p.ids[p.image_start: p.image_start + p.image_len]
        assert set(span) == {ours.spec.image_token_id}


def test_logits_match_transformers(models) -> None:  # noqa: ANN001
    ours, ref = models
    rng = np.random.default_rng(0)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in SIZES]
    assert sorted({im.grid.num_tiles for im in images})[-1] > 1  # several tile counts covered
    requests = [Request(i, q) for i in range(len(images)) for q in QUESTIONS]
    engine = TorchEngine(ours, EngineConfig(max_batch_tokens=300))  # forces several batches
    scores = engine.score(images, requests)
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    for r, s in zip(requests, scores):
        im = images[r.image]
        n_tokens = im.grid.num_tiles * ours.spec.tokens_per_tile
        ids = reference_ids(ours.tokenizer, r.question, n_tokens)
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([ids]),
                         pixel_values=reference_pixels(torch.from_numpy(im.tiles))).logits[0, -1]
        ly, ln = logits[yes].logsumexp(-1), logits[no].logsumexp(-1)
        assert abs(s.margin - float(ly - ln)) <= 1e-4
        assert abs(s.p_yes - float(torch.sigmoid(ly - ln))) <= 1e-5
        assert s.image_tokens == im.grid.num_tiles * ours.spec.tokens_per_tile


def test_full_logits_match(models) -> None:  # noqa: ANN001
    """The whole vocabulary row, not just the yes/no pair, for one multi-tile image."""
    ours, ref = models
    im = prepare(np.random.default_rng(1).integers(0, 256, (90, 200, 3), dtype=np.uint8),
                 ours.spec.tiling)
    engine = TorchEngine(ours, EngineConfig())
    p = ours.prompts.build(QUESTIONS[0], im)
    emb = engine.encode([im])
    with torch.no_grad():
        x = ours.llm.embed_tokens(torch.tensor([p.ids]))
        x[0, p.image_start: p.image_start + p.image_len] = emb[0].embeds
        got = ours.llm.prefill(x, torch.tensor([len(p.ids)]))[0][0]
        want = ref(input_ids=torch.tensor([list(p.ids)]),
                   pixel_values=reference_pixels(torch.from_numpy(im.tiles))).logits[0, -1]
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("per_question", [False, True])
def test_greedy_text_matches_transformers_generate(models, cache: bool,  # noqa: ANN001
                                                   per_question: bool) -> None:
    """Batched greedy decode (over cached prefixes or not) = transformers generate, token for
    token, for prompts of different lengths in one batch. ``per_question``: only every other
    request asks for text (its own max_new_tokens), so decode runs on a subset of the
    batch's rows; the others get none."""
    ours, ref = models
    rng = np.random.default_rng(2)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in [(56, 56), (200, 90)]]
    requests = [Request(i, q, (6 if k % 2 else None) if per_question else None)
                for i in range(2) for k, q in enumerate(QUESTIONS)]
    engine = TorchEngine(ours, EngineConfig(prefix_cache=cache,
                                            max_new_tokens=0 if per_question else 6))
    scores = engine.score(images, requests)
    for r, s in zip(requests, scores):
        if per_question and r.max_new_tokens is None:
            assert s.text is None
            continue
        im = images[r.image]
        ids = reference_ids(ours.tokenizer, r.question,
                            im.grid.num_tiles * ours.spec.tokens_per_tile)
        with torch.no_grad():
            out = ref.generate(input_ids=torch.tensor([ids]),
                               pixel_values=reference_pixels(torch.from_numpy(im.tiles)),
                               max_new_tokens=6, do_sample=False,
                               eos_token_id=sorted(engine.runner.stop_ids),
                               pad_token_id=ours.tokenizer.pad_token_id)
        want = ours.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert s.text == want
    assert sum(len(s.text or "") for s in scores) > 10  # the random model does produce text
