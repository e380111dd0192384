"""The embedding model's training (scripts/train_embed_model.py) computes the vectors the
embedder serves, and its losses reward alignment."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from scripts.train_embed_model import frozen_states, losses, pooled, scene_caption
from vlmbatch.cli.bench.shapes import make_scene
from vlmbatch.engine.config import EmbedConfig, EngineConfig, ModelConfig
from vlmbatch.engine.embed import EmbedHandle
from vlmbatch.engine.loading import image_plan_for, load_model
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.paths import DEFAULT_MODEL


def test_training_vectors_are_the_served_vectors() -> None:
    """Frozen lower layers + the trained top layers, as training runs them, give the
    embedder's vectors for images (1 to several tiles) and captions."""
    loaded = load_model(DEFAULT_MODEL)
    plan = image_plan_for(loaded.family, loaded.spec, ModelConfig())
    rng = np.random.default_rng(0)
    scenes = [make_scene(rng) for _ in range(3)]
    prepared = [plan.prepare(s.image) for s in scenes]
    assert len({len(p.tiles) for p in prepared}) > 1
    data, captions = frozen_states(loaded, [(p.tiles, scene_caption(s))
                                            for p, s in zip(prepared, scenes)], below=2)
    with torch.no_grad():
        img = F.normalize(pooled(loaded.llm, data, 2), dim=-1).numpy()
        txt = F.normalize(pooled(loaded.llm, list(captions.values()), 2), dim=-1).numpy()
    emb = EmbedHandle(TorchEngine(loaded, EngineConfig(prefix_cache=False)),
                   EmbedConfig(pooling="image-mean"))
    served = emb.embed(prepared, [EmbedRequest(i, None) for i in range(3)]
                       + [EmbedRequest(None, c) for c in captions])
    assert np.abs(np.stack([v.values for v in served[:3]]) - img).max() <= 1e-5
    assert np.abs(np.stack([v.values for v in served[3:]]) - txt).max() <= 1e-5


def test_losses_reward_alignment() -> None:
    torch.manual_seed(0)
    txt = torch.randn(4, 16)
    owner = torch.tensor([0, 1, 2, 3, 0, 1])
    aligned = txt[owner] + 0.01 * torch.randn(6, 16)
    ti_good, ii_good = losses(aligned, txt, owner, [8, 16], 0.05, 0.5)
    ti_bad, ii_bad = losses(aligned[torch.randperm(6)], txt, owner, [8, 16], 0.05, 0.5)
    assert ti_good < ti_bad and ii_good < ii_bad
