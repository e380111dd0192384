"""What a checkpoint declares about embeddings: its pooling, its Matryoshka sizes, its
multi-vector projection layer. Read from its files, no weights loaded (the projection's two
tensors are read on demand).

Declarations understood (the reference checkpoints' own names):

- ``config.json`` keys of jina-embeddings-v4: ``single_vector_pool_strategy`` (``"mean"``:
  jina's rule, an image's hidden states averaged over its vision span, a text's over its
  tokens, i.e. our ``image-mean``; ``"last"``), ``matryoshka_dims`` (the truncations it was
  trained for). The built-in embedding model writes the same keys.
- sentence-transformers' ``modules.json`` -> its Pooling module's ``config.json``
  (``pooling_mode_lasttoken``: ``last``, GME/VLM2Vec/E5-V style; ``pooling_mode_mean_tokens``:
  ``mean``).
- a multi-vector projection layer, by weight name: ``multi_vector_projector`` (jina) or
  ``embedding_proj_layer`` (ColQwen2), a linear on the last hidden states.

A checkpoint that declares none of these is a chat model: it still embeds (pooled hidden
states, with the family's default pooling), and ``declared`` is False so the CLI can say so.

Light (``pipeline/config.py`` and the CLI read ``POOLINGS`` from here): JSON files and
safetensors headers only; torch is loaded by safetensors when ``read_projection`` reads the
projection's tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from vlmbatch.models.config_io import ModelError, read_json, unreadable_weights

if TYPE_CHECKING:
    import torch

# mean: every real token of the prompt; image-mean: an image's span with its start/end markers
# (a text-only input: its tokens); last: the last real token
POOLINGS = ("mean", "image-mean", "last")
PROJECTION_NAMES = ("multi_vector_projector", "embedding_proj_layer")
_JINA_POOLING = {"mean": "image-mean", "last": "last"}


@dataclass(frozen=True)
class EmbeddingSpec:
    """A checkpoint's embedding declarations. Invariant: ``pooling`` is one of ``POOLINGS``;
    ``matryoshka_dims`` is sorted ascending (empty: none declared)."""
    pooling: str  # declared, else the family's default
    matryoshka_dims: tuple[int, ...]
    projection: str | None  # weight-name prefix of the multi-vector projection, if any
    declared: bool  # the checkpoint declares itself an embedding model
    multi_vector: bool = False  # one vector per token by default (ColQwen2)


def read_embedding_spec(path: Path, config: dict, default_pooling: str,
                        multi_vector: bool = False) -> EmbeddingSpec:
    """The declarations of the checkpoint at ``path`` (``config``: its config.json;
    ``default_pooling``, ``multi_vector``: its family's defaults, ``ModelFamily``); ModelError
    naming the file for a pooling we do not implement."""
    pooling, declared = _declared_pooling(path, config)
    dims = config.get("matryoshka_dims") or ()
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) and d > 0
                                                      for d in dims):
        raise ModelError(f"{path / 'config.json'}: matryoshka_dims must be a list of positive "
                         f"integers, got {dims!r}")
    projection = next((n for n in PROJECTION_NAMES if f"{n}.weight" in weight_names(path)),
                      None)
    return EmbeddingSpec(pooling or default_pooling, tuple(sorted(dims)), projection,
                         declared or bool(dims) or projection is not None, multi_vector)


def _declared_pooling(path: Path, config: dict) -> tuple[str | None, bool]:
    """(pooling or None, whether anything was declared) from config.json or a
    sentence-transformers Pooling module."""
    jina = config.get("single_vector_pool_strategy")
    if jina is not None:
        if jina not in _JINA_POOLING:
            raise ModelError(f"{path / 'config.json'}: single_vector_pool_strategy {jina!r} is "
                             f"not supported (only {sorted(_JINA_POOLING)})")
        return _JINA_POOLING[jina], True
    for module in _modules(path):
        if module.get("type", "").endswith("Pooling"):
            cfg_file = path / module.get("path", "") / "config.json"
            return _sentence_transformers_pooling(cfg_file, read_json(cfg_file)), True
    return None, False


def _modules(path: Path) -> list[dict]:
    """sentence-transformers' ``modules.json``: a list of ``{"type", "path", ...}``."""
    f = path / "modules.json"
    if not f.is_file():
        return []
    try:
        mods = json.loads(f.read_text())
    except ValueError as e:
        raise ModelError(f"{f} is not valid JSON ({e}); restore it from the original "
                         "checkpoint") from e
    if not isinstance(mods, list) or not all(isinstance(m, dict) for m in mods):
        raise ModelError(f"{f} is not a list of modules; restore it from the original "
                         "checkpoint")
    return mods


def _sentence_transformers_pooling(cfg_file: Path, cfg: dict) -> str:
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
    raise ModelError(f"{cfg_file}: pooling {modes} is not supported (mean tokens or last "
                     "token)")


def weight_names(path: Path) -> set[str]:
    """Every tensor name of the checkpoint's safetensors files (headers only)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(read_json(index).get("weight_map", {}))
    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                names.update(st.keys())
        except SafetensorError as e:
            raise unreadable_weights(f, e) from e
    return names


def read_projection(path: Path, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projection layer's (weight [D_out, D], bias [D_out] or None), by its prefix."""
    wanted = {f"{name}.weight", f"{name}.bias"}
    found: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for key in wanted & set(st.keys()):
                    found[key] = st.get_tensor(key)
        except SafetensorError as e:
            raise unreadable_weights(f, e) from e
    if f"{name}.weight" not in found:
        raise ModelError(f"{path}: no {name}.weight in the checkpoint's safetensors files")
    return found[f"{name}.weight"], found.get(f"{name}.bias")
