"""A checkpoint's embedding declarations (``models/embedding.py``), and a multi-vector
projection layer found in its weights and applied by the embedder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vlmbatch.engine.config import EmbedConfig, EngineConfig
from vlmbatch.engine.embed import EmbedHandle, embedding_checkpoint
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.embedding import read_embedding_spec
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL, DEFAULT_MODEL


def test_declarations(tmp_path: Path) -> None:
    spec = read_embedding_spec(tmp_path, {}, "image-mean")
    assert (spec.pooling, spec.matryoshka_dims, spec.projection, spec.declared) == (
        "image-mean", (), None, False)
    jina = read_embedding_spec(tmp_path, {"single_vector_pool_strategy": "mean",
                                          "matryoshka_dims": [256, 128]}, "last")
    assert (jina.pooling, jina.matryoshka_dims, jina.declared) == ("image-mean", (128, 256), True)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    assert read_embedding_spec(tmp_path, {}, "image-mean").pooling == "last"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token":
                                                                    True}))
    with pytest.raises(ModelError, match="not supported"):
        read_embedding_spec(tmp_path, {}, "image-mean")
    with pytest.raises(ModelError, match="matryoshka_dims"):
        read_embedding_spec(tmp_path / "none", {"matryoshka_dims": [0]}, "mean")


def test_builtin_models() -> None:
    assert embedding_checkpoint(DEFAULT_EMBED_MODEL) and not embedding_checkpoint(DEFAULT_MODEL)
    cfg = json.loads((DEFAULT_EMBED_MODEL / "config.json").read_text())
    spec = read_embedding_spec(DEFAULT_EMBED_MODEL, cfg, "mean")
    assert spec.pooling == "image-mean" and spec.matryoshka_dims == (32, 64, 128)


def test_projection_layer_is_applied(random_model_dir: Path, tmp_path: Path) -> None:
    """A ``multi_vector_projector`` (jina's name) in the weights: each token's vector is the
    projection of its last hidden state, then L2 (jina's multi-vector rule)."""
    path = tmp_path / "proj"
    shutil.copytree(random_model_dir, path)
    torch.manual_seed(0)
    w, b = torch.randn(8, 32), torch.randn(8)
    save_file({"multi_vector_projector.weight": w, "multi_vector_projector.bias": b},
              str(path / "projector.safetensors"))
    model = load_model(path)
    emb = EmbedHandle(TorchEngine(model, EngineConfig()), EmbedConfig(multi_vector=True))
    assert emb.resolved.spec.projection == "multi_vector_projector" and emb.resolved.spec.declared
    plain = EmbedHandle(TorchEngine(model, EngineConfig()), EmbedConfig(pooling="mean"))
    r = EmbedRequest(None, "a red circle")
    got = emb.embed([], [r])[0].values
    p = plain.prompt(r, [])
    with torch.no_grad():
        h, _ = model.llm.prefill_hidden(model.llm.embed_tokens(torch.tensor([p.ids])),
                                        torch.tensor([len(p.ids)]))
    want = F.normalize(h[0] @ w.T + b, dim=-1).numpy()
    assert got.shape == (len(p.ids), 8) and np.abs(got - want).max() <= 1e-5
