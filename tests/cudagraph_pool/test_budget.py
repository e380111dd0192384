"""Token-budget pool: packing, padding and slicing on the CPU with a fake packed callable
whose outputs depend on which rows share an image (so a wrong packing or meta shows)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from vlmbatch.cudagraph_pool.budget import BudgetPool, default_budgets, pack


def test_default_budgets() -> None:
    assert default_budgets(8192) == [1024, 2048, 4096, 8192]
    assert default_budgets(5000) == [1024, 2048, 4096, 5000]
    assert default_budgets(16, 16) == [16]


def test_pack_keeps_order_takes_the_smallest_budget_and_runs_giants_alone() -> None:
    budgets = [8, 16, 32]
    assert pack([4, 4], budgets) == [(0, 2, 8)]
    assert pack([4, 6, 20, 10], budgets) == [(0, 3, 32), (3, 4, 16)]
    assert pack([30, 40, 2], budgets) == [(0, 1, 32), (1, 2, 0), (2, 3, 8)]
    assert pack([], budgets) == []


class Segmented:
    """Fake packed encoder: rows [B, 5] -> (pair sums + mean over the row's own image, [B/2,
    3]) with ``meta["image"]`` [B] the image of each row (padding: one more image). Records
    the row counts it is called with."""

    def __init__(self) -> None:
        self.w = torch.randn(5, 3)
        self.seen: list[int] = []

    def __call__(self, x: torch.Tensor, meta: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        self.seen.append(x.shape[0])
        h = torch.tanh(x @ self.w)  # [B, 3]
        img = meta["image"]
        sums = torch.zeros_like(h).index_add_(0, img, h)
        mean = sums[img] / torch.bincount(img, minlength=len(h))[img, None]
        return ((h + mean).view(-1, 2, 3).sum(1),)

    @staticmethod
    def meta(layouts: Sequence[tuple[int, ...]], budget: int) -> dict[str, torch.Tensor]:
        sizes = [n for (n,) in layouts]
        ids = torch.arange(len(sizes) + 1).repeat_interleave(
            torch.tensor([*sizes, budget - sum(sizes)]))
        return {"image": ids}


@pytest.mark.parametrize("sizes", [[4], [2, 6, 4], [16, 2], [30, 2, 2], [40], [6] * 9])
def test_pool_equals_each_image_alone(sizes: list[int]) -> None:
    fn = Segmented()
    pool = BudgetPool(fn, fn.meta, (5,), torch.float32, "cpu", budgets=[8, 16, 32],
                      rows_per_out=2, unit=2)
    x = torch.randn(sum(sizes), 5)
    (out,) = pool(x, sizes, [(n,) for n in sizes])
    want, first = [], 0
    for n in sizes:  # alone: no padding, one image
        want.append(fn(x[first: first + n], fn.meta([(n,)], n))[0])
        first += n
    assert torch.allclose(out, torch.cat(want), atol=1e-6) and out.shape == (sum(sizes) // 2, 3)
    ran = fn.seen[: len(pool.calls)]
    assert all(b in (8, 16, 32) or b == 0 for b in pool.calls)
    assert [s for s, b in zip(ran, pool.calls) if b] == [b for b in pool.calls if b]
    assert (0 in pool.calls) == (max(sizes) > 32)  # only a giant runs uncaptured


def test_rejects_bad_inputs() -> None:
    fn = Segmented()
    pool = BudgetPool(fn, fn.meta, (5,), torch.float32, "cpu", [8], rows_per_out=2, unit=2)
    with pytest.raises(ValueError, match="sizes"):
        pool(torch.randn(6, 5), [4], [(4,)])
    with pytest.raises(ValueError, match="multiples"):
        pool(torch.randn(3, 5), [3], [(3,)])
    with pytest.raises(ValueError, match="multiples"):
        BudgetPool(fn, fn.meta, (5,), torch.float32, "cpu", [9], rows_per_out=2)
