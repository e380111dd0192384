"""CUDA graphs at fixed *token budgets* for callables over packed images of any size.

``GraphPool`` buckets batches of same-shape items; an encoder that takes several images of
different sizes as one packed sequence (Qwen-VL's towers) has no batch axis to bucket. As
vLLM's encoder CUDA graphs do, ``BudgetPool`` captures the callable once per budget B (total
rows, e.g. 1024, 2048, ... patches) and packs a call's images into budgets: images are taken
in order while they fit the largest budget, the group is padded up to the smallest budget
that holds it, replayed, and its real output rows sliced off. An image larger than every
budget runs alone, uncaptured, padded to a whole unit.

What the callable needs beside the rows (which rows attend which, positions) depends on the
images, so the caller gives two functions: ``meta(layouts, B) -> {name: tensor}`` makes it on
the host for a packing, in shapes fixed by B alone (copied into the graph's static inputs
before each replay), and ``fn(rows [B, *item_shape], meta) -> tuple of [B / rows_per_out,
...]``, whose first ``n / rows_per_out`` rows are the images' outputs. ``meta([], B)`` (all
padding) is what the capture runs on.

Guard and fallback as ``GraphPool``: outputs are cloned after the replay and, with ``sync``,
an event is waited on; without CUDA (or ``use_graphs=False``) the same packing and padding
call ``fn`` directly, so the logic is tested on the CPU with a fake callable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vlmbatch.cudagraph_pool.pool import capture_graph, guard

Layout = tuple[int, ...]
Meta = dict[str, torch.Tensor]


def default_budgets(largest: int, smallest: int = 1024) -> list[int]:
    """Doubling budgets ``smallest, 2 * smallest, ...`` up to and including ``largest``."""
    if not 1 <= smallest <= largest:
        raise ValueError(f"need 1 <= smallest <= largest, got {smallest}, {largest}")
    out = [smallest]
    while out[-1] * 2 < largest:
        out.append(out[-1] * 2)
    return out if out[-1] == largest else [*out, largest]


def pack(sizes: Sequence[int], budgets: Sequence[int]) -> list[tuple[int, int, int]]:
    """Images (rows each, in order) cut into groups ``(first, end, budget)``: consecutive
    images while their total fits the largest budget, each group with the smallest budget
    that holds it; an image over the largest budget alone, with budget 0 (uncaptured)."""
    top, groups, first, total = max(budgets), [], 0, 0
    for i, n in enumerate(sizes):
        if total and total + n > top:
            groups.append((first, i, min(b for b in budgets if b >= total)))
            first, total = i, 0
        if n > top:
            groups.append((i, i + 1, 0))
            first, total = i + 1, 0
            continue
        total += n
    if total:
        groups.append((first, len(sizes), min(b for b in budgets if b >= total)))
    return groups


@dataclass
class _BudgetGraph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor  # [budget, *item_shape]
    static_meta: Meta
    static_out: tuple[torch.Tensor, ...]


class BudgetPool:
    """``pool(rows, sizes, layouts)`` == ``fn`` run on the images one by one (module
    docstring); ``rows`` [sum(sizes), *item_shape], each size a multiple of ``unit``."""

    def __init__(self, fn: Callable[[torch.Tensor, Meta], tuple[torch.Tensor, ...]],
                 meta: Callable[[Sequence[Layout], int], Meta], item_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str, budgets: Sequence[int],
                 rows_per_out: int, unit: int = 1, use_graphs: bool | None = None,
                 sync: bool = True) -> None:
        if any(b % unit or b % rows_per_out for b in budgets):
            raise ValueError(f"budgets {list(budgets)} must be multiples of {unit} and "
                             f"{rows_per_out}")
        self.fn, self.meta, self.item_shape, self.dtype = fn, meta, tuple(item_shape), dtype
        self.device = torch.device(device)
        self.budgets = sorted(set(budgets))
        self.rows_per_out, self.unit = rows_per_out, unit
        on_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.use_graphs = on_cuda if use_graphs is None else (use_graphs and on_cuda)
        self.sync = sync
        self.graphs: dict[int, _BudgetGraph] = {}
        self.calls: deque[int] = deque(maxlen=4096)  # budgets run, in order (0: uncaptured)
        self.graph_bytes = 0

    def capture(self) -> None:
        """Capture every budget on all-padding input, largest first, one memory pool."""
        if not self.use_graphs or self.graphs:
            return
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.budgets):
            x = torch.zeros((b, *self.item_shape), dtype=self.dtype, device=self.device)
            meta = {k: v.to(self.device).clone() for k, v in self.meta([], b).items()}
            graph, out, nbytes = capture_graph(lambda: self.fn(x, meta), mempool, stream,
                                               self.device, f"budget {b}")
            self.graph_bytes += nbytes + x.nbytes + sum(v.nbytes for v in meta.values())
            self.graphs[b] = _BudgetGraph(graph, x, meta, out)
        torch.cuda.synchronize(self.device)

    def __call__(self, rows: torch.Tensor, sizes: Sequence[int],
                 layouts: Sequence[Layout]) -> tuple[torch.Tensor, ...]:
        if rows.shape[1:] != self.item_shape or rows.shape[0] != sum(sizes):
            raise ValueError(f"rows {tuple(rows.shape)} for sizes {list(sizes)}; pool built "
                             f"for items {self.item_shape}")
        if any(n % self.unit for n in sizes):
            raise ValueError(f"image sizes {list(sizes)} must be multiples of {self.unit}")
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        parts = [self._run(rows[starts[i]: starts[j]], layouts[i:j], b)
                 for i, j, b in pack(sizes, self.budgets)]
        out = tuple(torch.cat(p) if len(p) > 1 else p[0] for p in zip(*parts))
        if self.use_graphs and self.sync:
            guard(self.device)
        return out

    def _run(self, rows: torch.Tensor, layouts: Sequence[Layout],
             budget: int) -> tuple[torch.Tensor, ...]:
        """One group: padded to ``budget`` (0: to whole units, uncaptured), its real
        outputs (``rows / rows_per_out`` of each output)."""
        n, m = rows.shape[0], rows.shape[0] // self.rows_per_out
        self.calls.append(budget)
        if budget == 0 or not self.use_graphs:
            b = budget or -(-n // self.unit) * self.unit
            pad = rows.new_zeros((b - n, *self.item_shape))
            out = self.fn(torch.cat([rows, pad]) if b > n else rows, self.meta(layouts, b))
            return tuple(t[:m] for t in out)
        self.capture()
        g = self.graphs[budget]
        g.static_in[:n].copy_(rows)
        g.static_in[n:].zero_()
        for k, v in self.meta(layouts, budget).items():
            g.static_meta[k].copy_(v)  # same shapes: they depend on the budget only
        g.graph.replay()
        return tuple(t[:m].clone() for t in g.static_out)  # the next replay overwrites them
