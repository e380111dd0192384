"""Graph pool: bucketing, padding, splitting on CPU (fake callable); capture/replay on GPU."""

from __future__ import annotations

import pytest
import torch

from vlmbatch.cudagraph_pool.pool import GraphPool, default_buckets

CUDA = torch.cuda.is_available()


def test_default_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]


class Recorder:
    """Row-wise function that records the batch sizes it sees."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.w = torch.randn(5, 3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return torch.tanh(x @ self.w)  # [b, 5] -> [b, 3]


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 17, 32, 33, 70])
def test_pad_bucket_split_on_cpu(n: int) -> None:
    fn = Recorder()
    pool = GraphPool(fn, (5,), torch.float32, "cpu", max_batch=16)
    x = torch.randn(n, 5)
    out = pool(x)
    assert torch.allclose(out, torch.tanh(x @ fn.w), atol=1e-6)
    assert out.shape == (n, 3)
    assert all(b in pool.buckets for b in fn.seen)  # only bucket sizes reach fn
    assert sum(fn.seen) >= n and fn.seen == list(pool.calls)
    full, rest = divmod(n, 16)
    assert fn.seen[:full] == [16] * full  # split at the largest bucket
    if rest:
        assert fn.seen[-1] == pool.bucket(rest)


def test_rejects_wrong_item_shape() -> None:
    pool = GraphPool(Recorder(), (5,), torch.float32, "cpu", max_batch=4)
    with pytest.raises(ValueError, match="shape"):
        pool(torch.randn(2, 6))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graphs_match_eager_on_gpu() -> None:
    lin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 64)).cuda().eval()
    with torch.inference_mode():
        pool = GraphPool(lin, (64,), torch.float32, "cuda", max_batch=16)
        pool.capture()
        assert set(pool.graphs) == set(pool.buckets) and pool.graph_bytes >= 0
        for n in (1, 3, 16, 20):
            x = torch.randn(n, 64, device="cuda")
            assert torch.allclose(pool(x), lin(x), atol=1e-5)


def _slow_pool(sync: bool) -> tuple[GraphPool, object]:
    w = torch.randn(2048, 2048, device="cuda") / 45

    def slow(x: torch.Tensor) -> torch.Tensor:
        for _ in range(200):
            x = torch.tanh(x @ w)
        return x

    pool = GraphPool(slow, (2048,), torch.float32, "cuda", max_batch=8, sync=sync)
    pool.capture()
    return pool, slow


def _try(pool: GraphPool, slow) -> bool:  # noqa: ANN001
    """One hand-on with fresh inputs: run the pool on the current stream, then read its output
    on another stream that does not wait for the first (the write-up's race: features handed
    on before the GPU is done). The current stream is first held ~50 ms by a GPU sleep, so
    the replay and its clone are still queued when the reader runs: without the guard the
    reader sees unfinished memory every time, not only when timing happens to allow it.
    Fresh inputs each try, so memory left from an earlier try (which the allocator may hand
    the clone again) never holds the right answer by chance. True if what the reader saw is
    the right answer."""
    x = torch.randn(8, 2048, device="cuda")
    want = slow(x).cpu()  # eager; .cpu() also leaves the GPU idle before the pool runs
    torch.cuda._sleep(100_000_000)  # GPU cycles on the current stream, ahead of the replay
    out = pool(x)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        copy = out * 1.0
    other.synchronize()
    return torch.allclose(copy.cpu(), want, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_output_is_complete_when_handed_on() -> None:
    with torch.inference_mode():
        pool, slow = _slow_pool(sync=True)
        assert all(_try(pool, slow) for _ in range(5))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_without_the_guard_the_race_shows() -> None:
    """The same consumer without the event guard reads unfinished results, on every try: the
    GPU sleep in ``_try`` keeps the producer's stream busy past the read, so this fails if
    the pool ever handed on complete results without its guard (and so proves the guard
    test above is not passing by luck)."""
    with torch.inference_mode():
        pool, slow = _slow_pool(sync=False)
        wrong = sum(not _try(pool, slow) for _ in range(5))
    assert wrong == 5
