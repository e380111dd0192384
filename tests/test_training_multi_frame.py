"""The built-in model's multi-frame training items (scripts/train_default_model.py,
``--multi-frame``): the model is trained on what serving shows it, and the aux loss (which
reads one tile) leaves them out."""

from __future__ import annotations

import random

import numpy as np
import torch

from scripts.train_default_model import Batcher, multi_frame_data, normalise, train_step
from tests.test_training import scene_items, setup  # noqa: F401  (the fixture)
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import MediaItem, Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.preprocessing.media import PreparedVideo


def test_training_sees_what_the_engine_scores() -> None:
    """A clip item and an image-list item: the committed model's yes-minus-no logit at the
    end of the training sequence's prompt (features scattered as the training step does)
    equals ``TorchEngine.score``'s margin on the same parts (fp32, 1e-4)."""
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    items = multi_frame_data(DEFAULT_MODEL, 3, seed=5)
    assert isinstance(items[0][4][0], PreparedVideo) and len(items[2][4]) >= 2
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    hf = InternVLForConditionalGeneration.from_pretrained(str(DEFAULT_MODEL)).eval()
    batcher = Batcher(tok, hf.config.image_seq_length)
    batcher.set_prompts(DEFAULT_MODEL)
    engine = TorchEngine(load_model(DEFAULT_MODEL), EngineConfig())
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    for tiles, qa, _, _, parts in (items[0], items[2]):
        q, a = qa[0]
        ids, n_prompt = batcher.sequence(len(tiles), q, a, parts)
        assert tok.decode(ids[n_prompt:]) == a + "<|im_end|>"
        assert ids.count(batcher.ctx) == 16 * len(tiles)
        with torch.no_grad():
            feats = hf.model.get_image_features(pixel_values=normalise(tiles)).pooler_output
            x = torch.tensor([ids])
            embeds = hf.model.get_input_embeddings()(x).masked_scatter(
                (x == batcher.ctx).unsqueeze(-1), feats.reshape(-1, feats.shape[-1]))
            logits = hf(inputs_embeds=embeds).logits[0, n_prompt - 1]
        want = float(logits[yes].logsumexp(-1) - logits[no].logsumexp(-1))
        got = engine.score([MediaItem(parts)], [Request(0, q)])[0]  # type: ignore[list-item]
        assert abs(got.margin - want) <= 1e-4, (q, got.margin, want)


def test_the_aux_loss_leaves_multi_frame_items_out(setup) -> None:  # noqa: ANN001, F811
    """The aux head reads an item's last tile; a clip's target is over all its frames, so a
    clip in the batch must not change the aux loss (the match loss takes it)."""
    _, model, batcher, match, aux_head = setup
    batcher.set_prompts(DEFAULT_MODEL)
    single = scene_items(2, seed=4)
    clip = multi_frame_data(DEFAULT_MODEL, 1, seed=6)
    with torch.no_grad():
        _, aux_one, _ = train_step(model, aux_head, batcher, single, 2, random.Random(0),
                                   match, 2)
        _, aux_both, m = train_step(model, aux_head, batcher, single + clip, 2,
                                    random.Random(0), match, 2)
    torch.testing.assert_close(aux_one, aux_both)
    assert np.isfinite(float(m))
