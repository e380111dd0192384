"""The Qwen-VL towers at a fixed token budget (``models/qwen_vl/vision_static.py``): padded,
static-shape, equal to the eager tower; nothing in the forward a CUDA graph could not
capture; through ``cudagraph_pool.BudgetPool`` on the CPU; exported to ONNX at a budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.models.conftest import Pair
from tests.models.qwen_vl_helpers import rel_err
from vlmbatch.cudagraph_pool.budget import BudgetPool
from vlmbatch.cudagraph_pool.hazards import capture_hazards
from vlmbatch.models.base import BudgetForward
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.qwen_vl.vision_static import budget_forward, budget_meta
from vlmbatch.vit_trt.base import VisionModel
from vlmbatch.vit_trt.export import export_onnx
from vlmbatch.vit_trt.onnx_runner import OnnxRuntimeRunner

GRIDS = [(1, 4, 6), (1, 8, 4), (1, 2, 2), (1, 6, 10)]  # 24 + 32 + 4 + 60 = 120 rows
CPU = torch.device("cpu")


def rows(pair: Pair, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, pair.ours.spec.vision.row_size), dtype=torch.uint8,
                         generator=g)


def test_padded_budget_equals_the_eager_tower(pair: Pair) -> None:
    tower = pair.ours.vision
    n = sum(math.prod(g) for g in GRIDS)
    x = rows(pair, n)
    with torch.inference_mode():
        want = tower(x, GRIDS)
        for budget in (n, 128, 256):  # no padding, a little, more than the images
            padded = torch.cat([x, rows(pair, budget - n, seed=1)])  # padding: any values
            got = budget_forward(tower, padded, budget_meta(tower, GRIDS, budget, CPU))
            assert got[0].shape[0] == budget // 4
            for g, w in zip(got, (want.embeds, *want.deepstack)):
                assert rel_err(g[: n // 4], w) <= 1e-5
        assert len(got) == 1 + len(tower.spec.deepstack)


def test_budget_forward_has_nothing_capture_cannot_record(pair: Pair) -> None:
    tower = pair.ours.vision
    meta = budget_meta(tower, GRIDS[:2], 64, CPU)
    assert capture_hazards(budget_forward, tower, rows(pair, 64), meta) == []
    assert capture_hazards(tower, rows(pair, 56), GRIDS[:2])  # the eager form has some


def test_budget_pool_on_the_cpu_equals_the_eager_tower(pair: Pair) -> None:
    tower = pair.ours.vision
    pool = BudgetPool(lambda r, m: budget_forward(tower, r, m),
                      lambda d, b: budget_meta(tower, d, b, CPU),
                      (tower.spec.row_size,), torch.uint8, CPU, budgets=[32, 64, 96],
                      rows_per_out=4, unit=4)
    sizes = [math.prod(g) for g in GRIDS]
    x = rows(pair, sum(sizes), seed=2)
    with torch.inference_mode():
        embeds, *deep = pool(x, sizes, GRIDS)
        want = tower(x, GRIDS)
    assert list(pool.calls) == [64, 64]  # 24 + 32 + 4 rows, then 60: two groups of <= 64
    for g, w in zip((embeds, *deep), (want.embeds, *want.deepstack)):
        assert rel_err(g, w) <= 1e-5


def test_onnx_export_at_a_budget(pair: Pair, tmp_path: Path) -> None:
    tower = pair.ours.vision
    vision = VisionModel(tower, (tower.spec.row_size,), (tower.spec.out_hidden,), pair.path,
                         packed=True, budget=BudgetForward(budget_meta, budget_forward, 4, 4))
    result = export_onnx(vision, tmp_path, budget=128)
    assert result.max_abs_err <= 1e-4
    with pytest.raises(ModelError, match="--vit-backend torch"):
        OnnxRuntimeRunner(vision, result.onnx_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_budget_graphs_on_cuda_equal_the_eager_tower(pair: Pair) -> None:
    """Captured per budget, replayed with other images' rows and meta: = the eager tower."""
    dev = torch.device("cuda")
    tower = pair.ours.vision.to(dev)
    pool = BudgetPool(lambda r, m: budget_forward(tower, r, m),
                      lambda d, b: budget_meta(tower, d, b, dev),
                      (tower.spec.row_size,), torch.uint8, dev, budgets=[64, 128],
                      rows_per_out=4, unit=4)
    try:
        with torch.inference_mode():
            pool.capture()
            assert set(pool.graphs) == {64, 128}
            for grids in (GRIDS[:2], GRIDS[1:], GRIDS[3:]):
                sizes = [math.prod(g) for g in grids]
                x = rows(pair, sum(sizes), seed=len(grids)).to(dev)
                got = pool(x, sizes, grids)
                want = tower(x, grids)
                for g, w in zip(got, (want.embeds, *want.deepstack)):
                    assert rel_err(g, w) <= 1e-4
    finally:
        pair.ours.vision.to("cpu")
