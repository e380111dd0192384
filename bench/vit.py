"""Vision-encoder benchmark: backends side by side, one process, tiles/s and ratios.

CPU (default): torch eager fp32 vs onnxruntime (CPU EP) on the built-in model's encoder and
on a random encoder of InternViT-300M's shape (24 layers, hidden 1024, 16 heads, MLP 4096,
448 px tiles, patch 14; projector to 896 as InternVL3-1B).

GPU (``--device cuda``, run by bench/gpu_check.sh on a lent machine): eager fp16 and bf16 vs
the CUDA graph pool (bf16; as used, with its host wait per call, and without it) vs TensorRT
(fp16, with and without graphs, when ``tensorrt`` imports), batch 1..32, InternViT-300M shape;
ratios against eager bf16 (the pool's own dtype). The paths are interleaved per batch size
after a one-second warm-up, best of ``--rounds``, so none gains from the order it runs in.
``docs/status.md`` states where each row has actually run.

    python bench/vit.py                       # CPU
    python bench/vit.py --device cuda --encoders 300m
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.engine.loading import load_model, vision_model  # noqa: E402
from vlmbatch.models.internvl.vision import VisionEncoder, VisionSpec  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402
from vlmbatch.vit_trt.base import VisionModel  # noqa: E402
from vlmbatch.vit_trt.compile_runner import CompiledRunner  # noqa: E402
from vlmbatch.vit_trt.export import export_onnx  # noqa: E402
from vlmbatch.vit_trt.onnx_runner import OnnxRuntimeRunner  # noqa: E402

INTERNVIT_300M = VisionSpec(
    hidden=1024, layers=24, heads=16, intermediate=4096, patch=14, image_size=448,
    norm_type="layer_norm", eps=1e-6, qk_norm=False, act="gelu", mean_pooling=True,
    feature_layer=-1, drop_cls=True, downsample=0.5, projector_act="gelu", text_hidden=896,
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def encoder(name: str, model_dir: Path) -> tuple[torch.nn.Module, int]:
    if name == "builtin":
        m = load_model(model_dir)
        return m.vision, m.spec.tiling.tile_size
    torch.manual_seed(0)
    return VisionEncoder(INTERNVIT_300M).eval(), 448


def vision_of(vision: VisionEncoder, tile: int, model_dir: Path) -> VisionModel:
    """A bare encoder as a runner's ``VisionModel`` (tile in, tokens x text hidden out)."""
    return VisionModel(vision, (tile, tile, 3),
                       (vision.spec.tokens_per_tile(tile), vision.spec.text_hidden), model_dir)


def timed(fn, tiles: torch.Tensor, reps: int, cuda: bool) -> float:  # noqa: ANN001
    """tiles/s over ``reps`` calls after one warm-up."""
    fn(tiles)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(tiles)
    if cuda:
        torch.cuda.synchronize()
    del out
    return reps * tiles.shape[0] / (time.perf_counter() - start)


def cpu_rows(name: str, model_dir: Path, batches: list[int], reps: int,
             compiled: bool) -> None:
    vision, tile = encoder(name, model_dir)
    holder = vision_of(vision, tile, model_dir)
    comp = CompiledRunner(holder, max_batch=max(batches)) if compiled else None
    with tempfile.TemporaryDirectory() as tmp:
        export = export_onnx(holder, Path(tmp), check_batch=1)
        ort = OnnxRuntimeRunner(holder, export.onnx_path)
        for b in batches:
            tiles = torch.randint(0, 256, (b, tile, tile, 3), dtype=torch.uint8)
            with torch.inference_mode():
                eager = timed(vision, tiles, reps, False)
            o = timed(ort.encode, tiles, reps, False)
            c = timed(comp.encode, tiles, reps, False) if comp is not None else float("nan")
            print(f"{name:<9}{'cpu':<6}{b:>6}{eager:>14.1f}{o:>14.1f}{o / eager:>8.2f}"
                  f"{c:>14.1f}{c / eager:>8.2f}")


def gpu_rows(name: str, model_dir: Path, batches: list[int], reps: int, rounds: int,
             compiled: bool) -> None:
    import copy

    from vlmbatch.cudagraph_pool.pool import GraphPool

    vision, tile = encoder(name, model_dir)
    fp16 = copy.deepcopy(vision).to("cuda", torch.float16)
    bf16 = vision.to("cuda", torch.bfloat16)
    pool = GraphPool(bf16, (tile, tile, 3), torch.uint8, "cuda", max_batch=max(batches))
    with torch.inference_mode():
        pool.capture()
    print(f"graph pool memory: {pool.graph_bytes / 2**20:.0f} MiB")
    # the guard's host wait per call (sync=True, the default) costs the CPU/GPU overlap eager
    # keeps; "pool, no host wait" shows what that costs (same graphs, stream order only)
    nowait = copy.copy(pool)  # shares the captured graphs
    nowait.sync = False
    paths = {"eager fp16": fp16, "eager bf16": bf16, "graph pool bf16": pool,
             "pool, no host wait": nowait}
    if compiled:  # torch.compile per bucket, captured by the same pool (each bucket compiles
        # on its first call, inside timed()'s warm-up)
        paths["compile bf16 graphs"] = CompiledRunner(
            vision_of(bf16, tile, model_dir), max_batch=max(batches)).encode
    try:
        import tensorrt  # noqa: F401

        from vlmbatch.vit_trt.tensorrt_runner import TensorRTRunner

        holder = (vision_model(load_model(model_dir, "cuda")) if name == "builtin"
                  else None)
        if holder is not None:
            for graphs in (False, True):
                trt = TensorRTRunner(holder, profile=(1, 8, max(batches)), cuda_graphs=graphs)
                paths["tensorrt fp16" + (" graphs" if graphs else "")] = trt.encode
    except ImportError:
        print("tensorrt: not installed here, no TensorRT row")
    results: dict[str, dict[int, float]] = {p: {} for p in paths}
    with torch.inference_mode():
        warm = _tiles(max(batches), tile)
        t_end = time.perf_counter() + 1.0  # bring the clocks up before the first row
        while time.perf_counter() < t_end:
            bf16(warm)
            torch.cuda.synchronize()
        # paths interleaved per batch size, best of `rounds`: no path is favoured by running
        # first (cold clocks) or last
        for b in batches:
            tiles = _tiles(b, tile)
            for _ in range(rounds):
                for path, fn in paths.items():
                    results[path][b] = max(results[path].get(b, 0.0),
                                           timed(fn, tiles, reps, True))
    print(f"{'encoder':<9}{'path':<18}" + "".join(f"{b:>9}" for b in batches)
          + f"   (tiles/s, best of {rounds} interleaved rounds of {reps} calls)")
    base = results["eager bf16"]
    for path, row in results.items():
        print(f"{name:<9}{path:<18}" + "".join(f"{row[b]:>9.0f}" for b in batches))
        if path != "eager bf16":
            print(f"{'':<9}{'  x eager bf16':<18}" + "".join(f"{row[b] / base[b]:>9.2f}"
                                                            for b in batches))


def _tiles(b: int, tile: int) -> torch.Tensor:
    return torch.randint(0, 256, (b, tile, tile, 3), dtype=torch.uint8, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--encoders", default="builtin,300m")
    ap.add_argument("--reps", type=int, default=3, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=3,
                    help="GPU: interleaved rounds per batch size, best kept")
    ap.add_argument("--batches", default=None,
                    help="comma-separated batch sizes (default: 1..32 on GPU; CPU: 1,8,32 "
                    "for the built-in encoder, 1 for the 300M shape)")
    ap.add_argument("--compile", action="store_true",
                    help="add the --vit-backend compile path (torch.compile per bucket; each "
                    "bucket compiles on its first call: minutes for the 300M shape)")
    args = ap.parse_args()
    names = args.encoders.split(",")
    given = [int(b) for b in args.batches.split(",")] if args.batches else None
    if args.device.startswith("cuda"):
        for name in names:
            gpu_rows(name, args.model, given or [1, 2, 4, 8, 16, 32], args.reps, args.rounds,
                     args.compile)
        return
    print(f"{'encoder':<9}{'dev':<6}{'batch':>6}{'torch tiles/s':>14}{'ort tiles/s':>14}"
          f"{'ratio':>8}{'compile t/s':>14}{'ratio':>8}   ({torch.get_num_threads()} threads)")
    for name in names:
        batches = given or ([1, 8, 32] if name == "builtin" else [1])
        cpu_rows(name, args.model, batches, args.reps, args.compile)


if __name__ == "__main__":
    main()
