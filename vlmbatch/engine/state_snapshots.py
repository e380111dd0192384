"""Linear-attention state snapshots in the prefix cache (``docs/hybrid_cache.md``): how the
runner turns a batch's states into cache bytes and back.

A hybrid decoder (Qwen3.5) has, per linear layer and row, a conv state and a recurrent state
(``Decoder.state_shapes``: shapes and dtypes, the recurrent state float32). A snapshot is all
of them for one row, each tensor's bytes one after the other in layer order (``StateCodec``),
stored in the cache's byte arena under the key of the prefix's last block
(``PrefixCache.insert_state``). It is taken inside the forward that prefills the prompt: the
runner asks the decoder for the linear layers' states at each snapshot row's positions too
(``snapshot_at``, the decoder's ``state_at``: the image's end, the end of what its group
shares) and splits them from the states at the rows' ends (``take_snapshots``). Restoring
copies the snapshot's slots out of the arena in one gather for the batch and views the bytes
back as the tensors; rows without a snapshot get zero states, which a linear layer reads as
"no history".
"""

from __future__ import annotations

import math

import torch

from vlmbatch.engine.planner import Plan
from vlmbatch.engine.prefix_cache import PrefixCache
from vlmbatch.models.base import KV


class StateCodec:
    """Per-row state tensors <-> one row of bytes (module docstring). ``shapes``: each
    tensor's shape without the batch and its dtype, in order (conv, recurrent per layer)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.shapes = shapes
        self.sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
        self.nbytes = sum(self.sizes)

    def pack(self, states: list[torch.Tensor]) -> torch.Tensor:
        """Tensors ``[B, *shape]`` (in order) -> ``[B, nbytes]`` uint8."""
        b = states[0].shape[0]
        return torch.cat([t.to(dtype).contiguous().view(b, -1).view(torch.uint8)
                          for t, (_, dtype) in zip(states, self.shapes)], dim=1)

    def unpack(self, data: torch.Tensor) -> list[torch.Tensor]:
        """``[B, >= nbytes]`` uint8 -> the tensors ``[B, *shape]``."""
        out, at = [], 0
        for size, (shape, dtype) in zip(self.sizes, self.shapes):
            chunk = data[:, at: at + size].contiguous()
            out.append(chunk.view(dtype).view(data.shape[0], *shape))
            at += size
        return out


def restore(cache: PrefixCache, codec: StateCodec, batch: list[Plan],
            device: torch.device) -> list[torch.Tensor]:
    """The batch's states ``[B, *shape]`` per tensor of ``codec``: row j's from its plan's
    snapshot (``state_slots``), zeros where it has none."""
    rows = [j for j, p in enumerate(batch) if p.state_slots]
    zeros = [torch.zeros((len(batch), *shape), dtype=dtype, device=device)
             for shape, dtype in codec.shapes]
    if not rows:
        return zeros
    n = len(batch[rows[0]].state_slots)
    idx = torch.tensor([batch[j].state_slots for j in rows], device=cache.arena.device)
    data = cache.arena[idx].view(len(rows), -1)  # [R, n * slot_bytes]: one gather
    assert data.shape[1] == n * cache.slot_bytes
    states = codec.unpack(data)
    if len(rows) == len(batch):
        return states
    at = torch.tensor(rows, device=device)
    for full, got in zip(zeros, states):
        full[at] = got
    return zeros


def snapshot(cache: PrefixCache, codec: StateCodec, batch: list[Plan],
             columns: list[list[torch.Tensor]]) -> None:
    """Cache the snapshots the batch's plans ask for (``Plan.snapshots``): ``columns[p]``
    (``take_snapshots``, each as ``restore`` returns states) holds each row's p-th."""
    for p, states in enumerate(columns):
        rows = [j for j, plan in enumerate(batch) if len(plan.snapshots) > p]
        data = codec.pack([t[rows] if len(rows) < len(batch) else t for t in states])
        for j, row in zip(rows, data):
            cache.insert_state(batch[j].snapshots[p][1], row)


def snapshot_at(batch: list[Plan]) -> list[list[int]] | None:
    """Per row, the new tokens after which the decoder also returns the linear layers'
    states (``[B, P]``, the decoder's ``state_at``): a snapshot row's positions (it prefills
    from the start); its length where it has fewer (unused); None when no row takes one."""
    n = max(len(p.snapshots) for p in batch)
    if not n:
        return None
    return [[at - p.past_len for at, _ in p.snapshots] + [p.new_len] * (n - len(p.snapshots))
            for p in batch]


def take_snapshots(kinds: tuple[str, ...], new_kv: list[KV], b: int
                   ) -> tuple[list[KV], list[list[torch.Tensor]]]:
    """A prefill's per-layer output with ``state_at`` [B, P] (a linear layer's entries
    ``[(1 + P) B, ...]``: its state at each row's end, then at each column) -> (the same with
    each row's end state only; per column, its states flattened as ``split_layers`` gives
    them)."""
    out: list[KV] = []
    columns: list[list[torch.Tensor]] = []
    for kind, (x, y) in zip(kinds, new_kv):
        if kind != "linear":
            out.append((x, y))
            continue
        out.append((x[:b], y[:b]))
        cols = [(x[k * b: (k + 1) * b], y[k * b: (k + 1) * b]) for k in range(1, len(x) // b)]
        columns += [[] for _ in range(len(cols) - len(columns))]
        for col, pair in zip(columns, cols):
            col += pair
    return out, columns


def split_layers(kinds: tuple[str, ...], per_layer: list[KV]
                 ) -> tuple[list[KV], list[torch.Tensor]]:
    """A decoder's per-layer list -> (the full layers' k, v; the linear layers' state
    tensors flattened, conv then recurrent per layer)."""
    full = [kv for kind, kv in zip(kinds, per_layer) if kind == "full"]
    states = [t for kind, kv in zip(kinds, per_layer) if kind == "linear" for t in kv]
    return full, states


def join_layers(kinds: tuple[str, ...], full: list[KV],
                states: list[torch.Tensor]) -> list[KV]:
    """``split_layers``' inverse: the decoder's per-layer list."""
    out: list[KV] = []
    fi, si = iter(full), iter(states)
    for kind in kinds:
        out.append((next(si), next(si)) if kind == "linear" else next(fi))
    return out
