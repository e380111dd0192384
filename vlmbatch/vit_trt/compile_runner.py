"""The ``compile`` vision backend: ``torch.compile`` (inductor) of the family's vision module,
static shapes, one compiled shape per batch bucket.

TensorRT cannot be installed on any machine we have, so this is the compiled encoder that
runs here. Batches go through a ``cudagraph_pool.GraphPool`` built on the compiled callable:
it pads each batch to the smallest bucket (1, 2, 4, then multiples of 8) and splits larger
ones, so at most one compilation per bucket; on CUDA the pool then captures each bucket's
compiled kernels in a CUDA graph (the default mode of ``torch.compile``, without its own
cudagraphs, so that the pool's memory pool and guard are the same as the torch backend's).

Invariant (``VitRunner``): results equal the eager module's (``tests/vit_trt/
test_compile_runner.py``, fp32 CPU, 1e-5); the first call of each bucket pays its
compilation (tens of seconds on a CPU), so benchmarks warm every bucket first.
"""

from __future__ import annotations

import torch

from vlmbatch.cudagraph_pool.pool import GraphPool
from vlmbatch.vit_trt.base import RunnerOptions, VisionModel, VitRunner


class CompiledRunner(VitRunner):
    def __init__(self, vision: VisionModel, cuda_graphs: bool = True, max_batch: int = 32,
                 stream_ordered: bool = False) -> None:
        self.device = vision.device
        module = vision.module
        with torch.inference_mode():  # one eager call first: it fills per-device caches
            module(torch.zeros((1, *vision.item_shape), dtype=torch.uint8, device=self.device))
        self.compiled = torch.compile(module, dynamic=False)
        on_cuda = self.device.type == "cuda"
        self.buckets = GraphPool(self.compiled, vision.item_shape, torch.uint8, self.device,
                                 max_batch=max_batch, use_graphs=cuda_graphs and on_cuda,
                                 sync=not stream_ordered)
        self.pool = self.buckets  # what the engine's summary reads (graphs, their memory)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.buckets(pixels.to(self.device, non_blocking=True))


def build_compiled(vision: VisionModel, opts: RunnerOptions) -> CompiledRunner:
    return CompiledRunner(vision, cuda_graphs=opts.cuda_graphs, max_batch=opts.max_batch,
                          stream_ordered=opts.stream_ordered)
