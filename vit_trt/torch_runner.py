"""The ``torch`` vision backend: the family's module, on CUDA optionally through the graph
pool (``cudagraph_pool``): one graph per batch-size bucket for tile models, one per
token budget for packed ones (Qwen-VL) whose module can run on a padded budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cudagraph_pool import GraphPool
from models.base import VisionOutput
from vit_trt.base import RUNNERS, RunnerOptions, VisionModel, VitRunner


class TorchRunner(VitRunner):
    def __init__(self, vision: VisionModel, cuda_graphs: bool = False, max_batch: int = 32,
                 stream_ordered: bool = False) -> None:
        self.vision = vision.module
        self.device = vision.device
        self.packed = vision.packed
        self.pool: GraphPool | None = None
        if cuda_graphs and self.device.type == "cuda" and not self.packed:
            # the pool's guard (a host wait on an event after each call) protects readers on
            # other streams or the CPU; a stream-ordered consumer needs none
            self.pool = GraphPool(self.vision, vision.item_shape, torch.uint8, self.device,
                                  max_batch=max_batch, sync=not stream_ordered)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.to(self.device, non_blocking=True)
        return self.pool(x) if self.pool is not None else self.vision(x)

    @torch.inference_mode()
    def encode_packed(self, rows: torch.Tensor,
                      dims: Sequence[tuple[int, ...]]) -> VisionOutput:
        if not self.packed:
            return super().encode_packed(rows, dims)
        out = self.vision(rows.to(self.device, non_blocking=True), list(dims))
        assert isinstance(out, VisionOutput)
        return out


@RUNNERS.register("torch")
def _torch(vision: VisionModel, opts: RunnerOptions) -> TorchRunner:
    return TorchRunner(vision, cuda_graphs=opts.cuda_graphs, max_batch=opts.max_batch,
                       stream_ordered=opts.stream_ordered)
