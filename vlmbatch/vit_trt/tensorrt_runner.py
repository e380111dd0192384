"""TensorRT runner for the vision encoder (GPU only; **never run by us**).

Written against TensorRT 10's Python API (``tensorrt``: Builder, OnnxParser, optimisation
profiles, ``build_serialized_network``, ``Runtime.deserialize_cuda_engine``, the name-based
``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3`` I/O); pinned below 11,
which dropped the FP16/BF16 builder flags used here. TensorRT's libraries come only from
NVIDIA's own package index (PyPI's ``tensorrt-cu1x-libs`` are stubs that download from it),
which none of our machines reaches, and the lent GPU machine has no tensorrt either (its
libraries are far over what a device call may carry); ``tests/vit_trt/test_runners.py``'s
TensorRT test runs wherever tensorrt and a GPU exist and is skipped elsewhere.

I/O goes through torch CUDA tensors (pycuda does not build on our machines): by default
through the graph pool, which replays on the caller's current stream; with ``--no-cuda-graphs``
on a stream of the runner's own, ordered after the caller's. ``encode`` returns once the results are
complete. The serialised plan is cached on disk under a key of model hash, TensorRT version,
GPU name, precision and the batch profile ``[1, opt, max]``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.cudagraph_pool.pool import GraphPool, default_buckets
from vlmbatch.models.config_io import ModelError
from vlmbatch.vit_trt.base import RunnerOptions, VisionModel, VitRunner
from vlmbatch.vit_trt.export import export_onnx, model_hash
from vlmbatch.vit_trt.onnx_runner import PACKED

CACHE_DIR = Path(os.environ.get("VLMBATCH_CACHE", Path.home() / ".cache" / "vlmbatch")) / "trt"


def plan_key(model_hash: str, trt_version: str, gpu: str, precision: str,
             profile: tuple[int, int, int]) -> str:
    raw = f"{model_hash}|{trt_version}|{gpu}|{precision}|{profile}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def build_plan(onnx_path: Path, tile: int, profile: tuple[int, int, int],
               precision: str = "fp16", workspace_gib: int = 4) -> bytes:
    """ONNX -> serialised TensorRT plan with a dynamic batch profile ``(min, opt, max)``."""
    import tensorrt as trt  # optional dependency: NVIDIA's index only

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_gib << 30)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    opt = builder.create_optimization_profile()
    name = network.get_input(0).name
    lo, mid, hi = profile
    opt.set_shape(name, (lo, tile, tile, 3), (mid, tile, tile, 3), (hi, tile, tile, 3))
    config.add_optimization_profile(opt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the engine (see its log above)")
    return bytes(plan)


class TensorRTRunner(VitRunner):
    """``encode`` through a TensorRT engine; with ``cuda_graphs`` (the default) through the
    batch-size-bucketed graph pool, one execution context per bucket: a captured graph fixes
    its context's input shape and tensor addresses, so contexts are not shared between graphs
    (each holds its own activation memory, ``engine.device_memory_size``)."""

    def __init__(self, vision: VisionModel, onnx_path: Path | None = None,
                 precision: str = "fp16", profile: tuple[int, int, int] = (1, 8, 32),
                 cuda_graphs: bool = True) -> None:
        if vision.packed:
            raise ModelError(PACKED.format("TensorRT"))
        try:  # optional dependency: NVIDIA's index only
            import tensorrt as trt
        except ImportError as e:
            raise ImportError("--vit-backend tensorrt needs TensorRT 10 (from NVIDIA's package "
                              "index) and a CUDA GPU") from e
        if not torch.cuda.is_available():
            raise RuntimeError("--vit-backend tensorrt needs a CUDA GPU")
        if len(vision.item_shape) != 3 or vision.item_shape[0] != vision.item_shape[1]:
            raise ValueError(f"the TensorRT runner takes square tiles [S, S, 3], not "
                             f"{vision.item_shape}")
        tile = vision.item_shape[0]
        key = plan_key(model_hash(vision.source), trt.__version__,
                       torch.cuda.get_device_name(), precision, profile)
        plan_path = CACHE_DIR / f"{key}.plan"
        if not plan_path.is_file():
            if onnx_path is None:
                onnx_path = export_onnx(vision, CACHE_DIR / key).onnx_path
            plan = build_plan(onnx_path, tile, profile, precision)
            # whole or not at all: a plan cut short by a signal would fail every later load
            with replaced_on_success(plan_path) as part:
                part.write_bytes(plan)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_in = [self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names]
        self.input = names[is_in.index(True)]
        self.output = names[is_in.index(False)]
        self.max_batch = profile[2]
        self.out_shape = vision.out_shape
        self.device = torch.device("cuda")

        self.pool = None
        # batch size -> (its execution context, its output buffer), for the graphs
        self.contexts: dict[int, tuple[object, torch.Tensor]] = {}
        if cuda_graphs:
            buckets = [b for b in default_buckets(self.max_batch) if b >= profile[0]]
            self.pool = GraphPool(self._enqueue, (tile, tile, 3), torch.uint8, self.device,
                                  buckets=buckets)
        else:  # one context for every batch size, on a stream of its own (TensorRT on
            # torch's legacy default stream would add a sync per call; it warns)
            self.context = self.engine.create_execution_context()
            self.stream = torch.cuda.Stream(self.device)

    def _launch(self, ctx, x: torch.Tensor, out: torch.Tensor,  # noqa: ANN001
                stream: torch.cuda.Stream) -> None:
        """Enqueue ``ctx`` reading ``x`` and writing ``out`` on ``stream``."""
        ctx.set_tensor_address(self.input, x.data_ptr())
        ctx.set_tensor_address(self.output, out.data_ptr())
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")

    def _enqueue(self, x: torch.Tensor) -> torch.Tensor:
        """The pool's callable: one enqueue on the current stream, for a batch of bucket size.
        The pool calls it once to warm up, waits, then again under capture, with the same
        static input; shapes and addresses are set at the warm-up and unchanged at capture."""
        n = x.shape[0]
        if n not in self.contexts:
            ctx = self.engine.create_execution_context()
            out = torch.empty((n, *self.out_shape), dtype=torch.float32, device=self.device)
            ctx.set_input_shape(self.input, tuple(x.shape))
            self.contexts[n] = (ctx, out)
        ctx, out = self.contexts[n]
        self._launch(ctx, x, out, torch.cuda.current_stream(self.device))
        return out

    @torch.inference_mode()
    def encode(self, tiles: torch.Tensor) -> torch.Tensor:
        if isinstance(self.pool, GraphPool):  # replays on the current stream; complete after
            return self.pool(tiles.to(self.device).contiguous())
        outs = []
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # inputs and outputs allocated in this stream's order
            for i in range(0, tiles.shape[0], self.max_batch):
                x = tiles[i: i + self.max_batch].to(self.device).contiguous()
                out = torch.empty((x.shape[0], *self.out_shape), dtype=torch.float32,
                                  device=self.device)
                self.context.set_input_shape(self.input, tuple(x.shape))
                self._launch(self.context, x, out, stream)
                outs.append(out)
            result = torch.cat(outs)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()  # hand on complete results only (the write-up's race)
        return result


def build_tensorrt(vision: VisionModel, opts: RunnerOptions) -> TensorRTRunner:
    # the optimisation profile [1, opt, max]: max is the largest batch the runner prepares for
    top = opts.max_batch
    return TensorRTRunner(vision, opts.onnx_path, profile=(1, min(8, top), top),
                          cuda_graphs=opts.cuda_graphs)
