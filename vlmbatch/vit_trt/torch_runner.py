"""The ``torch`` vision backend: the family's module, on CUDA optionally through a graph
pool (``cudagraph_pool``): one graph per batch-size bucket for tile models
(``GraphPool``), one per token budget for packed ones whose family gives a static-shape form
(``BudgetPool``, Qwen-VL: ``models/qwen_vl/vision_static.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vlmbatch.cudagraph_pool.budget import BudgetPool, default_budgets
from vlmbatch.cudagraph_pool.pool import GraphPool
from vlmbatch.models.base import VisionOutput
from vlmbatch.vit_trt.base import RunnerOptions, VisionModel, VitRunner


class TorchRunner(VitRunner):
    def __init__(self, vision: VisionModel, cuda_graphs: bool = False, max_batch: int = 32,
                 stream_ordered: bool = False, max_budget: int = 16384) -> None:
        self.vision = vision.module
        self.device = vision.device
        self.packed = vision.packed
        self.pool: GraphPool | BudgetPool | None = None
        if not cuda_graphs or self.device.type != "cuda":
            return
        # the pool's guard (a host wait on an event after each call) protects readers on
        # other streams or the CPU; a stream-ordered consumer needs none
        if not self.packed:
            self.pool = GraphPool(self.vision, vision.item_shape, torch.uint8, self.device,
                                  max_batch=max_batch, sync=not stream_ordered)
        elif (b := vision.budget) is not None:
            m, device = self.vision, self.device
            self.pool = BudgetPool(lambda rows, meta: b.forward(m, rows, meta),
                                   lambda dims, n: b.meta(m, dims, n, device),
                                   vision.item_shape, torch.uint8, device,
                                   default_budgets(max_budget), b.rows_per_token, b.unit,
                                   sync=not stream_ordered)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.to(self.device, non_blocking=True)
        return self.pool(x) if isinstance(self.pool, GraphPool) else self.vision(x)

    @torch.inference_mode()
    def encode_packed(self, rows: torch.Tensor,
                      dims: Sequence[tuple[int, ...]]) -> VisionOutput:
        """Packed images; through the budget pool when there is one (its row counts are
        each image's ``prod(dims)``, a Qwen-VL grid's patches)."""
        if not self.packed:
            return super().encode_packed(rows, dims)
        x = rows.to(self.device, non_blocking=True)
        if isinstance(self.pool, BudgetPool):
            sizes = [math.prod(d) for d in dims]
            embeds, *deep = self.pool(x, sizes, dims)
            return VisionOutput(embeds, tuple(deep))
        out = self.vision(x, list(dims))
        assert isinstance(out, VisionOutput)
        return out


def build_torch_runner(vision: VisionModel, opts: RunnerOptions) -> TorchRunner:
    return TorchRunner(vision, cuda_graphs=opts.cuda_graphs, max_batch=opts.max_batch,
                       stream_ordered=opts.stream_ordered, max_budget=opts.max_budget)
