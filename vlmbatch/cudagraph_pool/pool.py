"""A pool of CUDA graphs keyed by batch-size bucket, for a callable of fixed per-item shape.

CUDA graphs replay a captured sequence of kernels with no CPU launch gaps, but only for the
shapes they were captured with. The pool (the 58.com write-up's CUDA-graph step; mini-sglang's
``engine/graph.py``) therefore captures one graph per bucket (1, 2, 4, then every multiple of
8 up to max),
largest first so that the smaller ones reuse its memory from one shared pool, and serves a
batch of n items by copying it into the static input of the smallest bucket >= n, padding the
rest with zeros, replaying, and slicing n rows of the static output. Batches larger than the
largest bucket are split.

The race the write-up hit: a graph's static output is overwritten by the next replay, and
work on the GPU is asynchronous. ``__call__`` therefore clones the rows it hands on (ordered
after the replay on the same stream) and, with ``sync=True`` (the default), waits on an event
recorded after that clone, so a consumer on another stream or on the CPU never reads a
half-written tensor. ``tests/cudagraph_pool`` has the GPU test that shows the guard matters.

Without CUDA (or with ``use_graphs=False``) the pool calls the function directly with the same
bucketing, padding and splitting, so the logic is tested on CPU with a fake callable.

The callable may be a torch module or anything that enqueues on the current stream, such as a
TensorRT execution context (``vit_trt/tensorrt_runner.py``, one context per bucket). What the
callable may do inside a capture is checked on the CPU too: ``cudagraph_pool.hazards``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch


def default_buckets(max_batch: int) -> list[int]:
    """``[1, 2, 4] + [8, 16, 24, ...]`` up to and including ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    b = [x for x in (1, 2, 4) if x <= max_batch] + list(range(8, max_batch + 1, 8))
    return b if b[-1] == max_batch else b + [max_batch]


T = TypeVar("T")


def capture_graph(run: Callable[[], T], mempool: torch.cuda._POOL_HANDLE, stream: torch.cuda.Stream,
                  device: torch.device, what: str) -> tuple[torch.cuda.CUDAGraph, T, int]:
    """Warm ``run`` up outside a graph, then capture it on ``stream`` into ``mempool``:
    (graph, its static output, device bytes the capture added to the graphs' pool)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, autotune)
        run()
    stream.synchronize()  # TensorRT asks for a finished enqueue before its capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: measure after it
    before = torch.cuda.memory_reserved(device)
    try:  # capture on the warm-up's stream: per-stream workspaces already exist there
        with torch.cuda.graph(graph, pool=mempool, stream=stream):
            out = run()
    except RuntimeError as e:
        raise RuntimeError(
            f"CUDA graph capture of {what} failed: {e}. The callable does host work inside "
            "its forward; cudagraph_pool.capture_hazards(fn, x) names the op on the CPU. To "
            "run without graphs: --no-cuda-graphs.") from e
    # the graphs' private pool (kept reserved for replays) grows only under capture
    return graph, out, torch.cuda.memory_reserved(device) - before


def guard(device: torch.device) -> None:
    """Wait on an event recorded after the work queued so far (the pools' completion
    guard: a consumer on another stream or the CPU never reads a half-written output)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor  # [bucket, *item_shape]
    static_out: torch.Tensor  # [bucket, *out_item_shape]


class GraphPool:
    """``pool(x)`` == ``fn(x)`` for x of shape ``[n, *item_shape]``, any n >= 1."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], item_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str, max_batch: int = 32,
                 buckets: list[int] | None = None, use_graphs: bool | None = None,
                 sync: bool = True) -> None:
        self.fn = fn
        self.item_shape = tuple(item_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.buckets = sorted(set(buckets or default_buckets(max_batch)))
        on_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.use_graphs = on_cuda if use_graphs is None else (use_graphs and on_cuda)
        self.sync = sync
        self.graphs: dict[int, _Graph] = {}
        # bucket sizes of the most recent runs, in order (tests and stats); bounded, as a long
        # job calls the pool millions of times
        self.calls: deque[int] = deque(maxlen=4096)
        self.graph_bytes = 0  # device memory the graphs keep: their private pool + static inputs

    def bucket(self, n: int) -> int:
        """Smallest bucket >= n (n <= the largest bucket)."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch {n} exceeds the largest bucket {self.buckets[-1]}")

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        if not self.use_graphs or self.graphs:
            return
        self.graph_bytes = 0
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            static_in = torch.zeros((b, *self.item_shape), dtype=self.dtype, device=self.device)
            graph, static_out, nbytes = capture_graph(lambda: self.fn(static_in), mempool,
                                                      stream, self.device, f"batch {b}")
            self.graph_bytes += nbytes + static_in.nbytes
            self.graphs[b] = _Graph(graph, static_in, static_out)
        torch.cuda.synchronize(self.device)

    def _run(self, chunk: torch.Tensor) -> torch.Tensor:
        n = chunk.shape[0]
        b = self.bucket(n)
        self.calls.append(b)
        if not self.use_graphs:
            if b == n:
                return self.fn(chunk)
            pad = chunk.new_zeros((b - n, *self.item_shape))
            return self.fn(torch.cat([chunk, pad]))[:n]
        self.capture()
        g = self.graphs[b]
        g.static_in[:n].copy_(chunk)
        if b > n:
            g.static_in[n:].zero_()
        g.graph.replay()
        return g.static_out[:n].clone()  # the next replay overwrites static_out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1:] != self.item_shape:
            raise ValueError(f"items of shape {tuple(x.shape[1:])}, pool built for "
                             f"{self.item_shape}")
        top = self.buckets[-1]
        outs = [self._run(x[i: i + top]) for i in range(0, x.shape[0], top)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.use_graphs and self.sync:
            guard(self.device)
        return out
