"""Pooling definitions (which prompt positions make a vector), their device maths, Matryoshka
truncation and late-interaction scores (MaxSim).

The three poolings (``models.embedding.POOLINGS``), over the last hidden states (after the
decoder's final norm, transformers' ``hidden_states[-1]``):

- ``image-mean`` (jina-embeddings-v4's rule, InternVL's default): an input with an image,
  the mean over its span *with* its start and end markers (``<img>``..``</img>`` as jina
  takes ``<|vision_start|>``..``<|vision_end|>``); a text alone, the mean over its tokens;
- ``mean``: the mean over every real token of the prompt;
- ``last``: the last real token (GME / VLM2Vec / E5-V).

then L2. A causal model's hidden state at a position depends on earlier positions only, so
nothing after a pooled range's end can change the vector: the embedder computes the prompt up
to that end (``PoolRange.end``), and may take cached KV for positions before its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlmbatch.models.base import Prompt


@dataclass(frozen=True)
class PoolRange:
    """Prompt positions ``[start, end)`` whose hidden states make the vector (every one of
    them, each its own row, for a multi-vector)."""
    start: int
    end: int


def pool_range(prompt: Prompt, pooling: str, multi_vector: bool = False) -> PoolRange:
    """The positions ``pooling`` reads in ``prompt`` (every position for a multi-vector, as
    jina and ColQwen2 project every token of the input)."""
    n = len(prompt.ids)
    if multi_vector or pooling == "mean" or (pooling == "image-mean" and not prompt.image_len):
        return PoolRange(0, n)
    if pooling == "last":
        return PoolRange(n - 1, n)
    if pooling == "image-mean":  # markers at image_start - 1 and image_start + image_len
        return PoolRange(prompt.image_start - 1, prompt.image_start + prompt.image_len + 1)
    raise ValueError(f"unknown pooling {pooling!r}")


def mean_rows(hidden: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """hidden ``[B, T, D]``, start/end ``[B]`` (0 <= start < end <= T) -> the mean of each
    row's positions ``[start, end)`` ``[B, D]``, in float32 whatever the model's dtype."""
    pos = torch.arange(hidden.shape[1], device=hidden.device)
    keep = (pos[None] >= start[:, None]) & (pos[None] < end[:, None])  # [B, T]
    total = (hidden.float() * keep[..., None]).sum(1)
    return total / keep.sum(1, keepdim=True)


def unit(x: torch.Tensor, dims: int | None = None) -> torch.Tensor:
    """``x [..., D]`` -> its first ``dims`` components (all: None), L2-normalised along the
    last axis (Matryoshka: truncate, then re-normalise)."""
    return F.normalize(x[..., :dims] if dims else x, dim=-1)


def maxsim(queries: np.ndarray | Sequence[np.ndarray],
           docs: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
    """Late-interaction scores ``[Q, N]``: for query i and document j, the sum over query
    token vectors of their best dot product with any of the document's token vectors
    (ColBERT's MaxSim, as ColQwen2's ``score_retrieval``). Each query/document is a
    ``[T, D]`` array (a single ``[T, D]`` array is one query or document); only real tokens
    take part (ColQwen2 pads a batch with zero vectors, which score 0: the same unless every
    real dot product of a query token is negative)."""
    qs = [queries] if isinstance(queries, np.ndarray) else list(queries)
    ds = [docs] if isinstance(docs, np.ndarray) else list(docs)
    for x in (*qs, *ds):
        if x.ndim != 2:
            raise ValueError(f"maxsim takes [tokens, dim] arrays (multi-vector embeddings), "
                             f"got shape {list(x.shape)}")
    out = np.zeros((len(qs), len(ds)), np.float32)
    for j, d in enumerate(ds):
        for i, q in enumerate(qs):
            out[i, j] = (q.astype(np.float32) @ d.astype(np.float32).T).max(1).sum()
    return out
