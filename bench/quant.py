"""Quantisation benchmark: accuracy, weight bytes, peak RSS and QPM of each quantised path.

Rows (the built-in model unless ``--model``):
  fp32          the float model, torch ViT;
  rtn           W4A16 round-to-nearest (no calibration: the floor AWQ/GPTQ must beat);
  awq, gptq     W4A16 from ``vlmbatch quantize``, calibrated on ``--calib-samples`` questions
                of easy-vqa's *train* split (never the test split);
  llm-int8      torch dynamic int8 linears in the language model (``--llm-quant int8-dynamic``);
  vit-int8      onnxruntime dynamic int8 vision encoder (``--vit-backend onnxruntime-int8``);
  vit-fp32-ort  the float ONNX encoder on onnxruntime: the fair speed baseline for vit-int8.

For each: easy-vqa test yes/no accuracy and mean |P(yes) - P(yes) of fp32| per question (all
7,136 questions unless ``--limit``); language-model weight bytes as held in memory (vision
encoder bytes for the ViT rows: its ONNX file); peak RSS of a fresh process that loads the row
and answers the QPM subset (``--rss``); QPM for short answers (scoring only: one forward per
question) and for long ones (``--long-tokens`` generated tokens, EOS ignored), timed in
``--rounds`` interleaved rounds over all rows in this one process, best round kept. The
built-in model's language model is 3 MiB, far too small for weight bytes to limit speed, so
a second table times one decoder layer's linears at Qwen2-0.5B's shapes (random weights)
for each kind of weight, at decode and prefill batch sizes. Not a test: timings on shared
machines are noisy; compare rows of one run.

    python bench/quant.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.cli.evaluate import easy_vqa_set  # noqa: E402
from vlmbatch.cli.quantize import quantize_model  # noqa: E402
from vlmbatch.engine.build import build_engine  # noqa: E402
from vlmbatch.engine.config import EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402
from vlmbatch.pipeline.drive import answer_group  # noqa: E402
from vlmbatch.quant.int4 import Int4Linear  # noqa: E402


@dataclass
class Row:
    name: str
    model: Path
    llm_quant: str = "none"
    vit: str = "torch"
    p_yes: list[float] = field(default_factory=list)
    correct: int = 0
    short_qpm: float = 0.0
    long_qpm: float = 0.0
    weight_bytes: int = 0
    rss_mib: float = 0.0
    engines: dict = field(default_factory=dict)

    def engine(self, long_tokens: int = 0):  # noqa: ANN201
        if long_tokens not in self.engines:
            self.engines[long_tokens] = build_engine(
                ModelConfig(self.model, llm_quant=self.llm_quant),
                EngineConfig(vit_backend=self.vit, max_new_tokens=long_tokens,
                             ignore_eos=long_tokens > 0))
        return self.engines[long_tokens]


def llm_weight_bytes(llm: torch.nn.Module) -> int:
    """Bytes of the language model's weights as held in memory (tied tensors once)."""
    seen, total = set(), 0
    for m in llm.modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if type(m).__name__ == "Linear" and hasattr(m, "_packed_params"):  # torch dynamic int8
            w, b = m._packed_params._weight_bias()
            tensors = [w] + ([b] if b is not None else [])
        for t in tensors:
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def vit_bytes(row: Row) -> int:
    runner = row.engine().vision
    session = getattr(runner, "session", None)
    if session is None:
        vision = row.engine().model.vision
        return sum(p.numel() * p.element_size() for p in vision.parameters())
    return Path(runner.onnx_path).stat().st_size


def answer(row: Row, items: list, long_tokens: int = 0, per_batch: int = 16) -> list:
    engine = row.engine(long_tokens)
    if engine.cache is not None:
        engine.cache.clear()
    answers = []
    for g in range(0, len(items), per_batch):
        answers += answer_group(engine, items[g: g + per_batch])
    return answers


# One decoder layer of Qwen2-0.5B (the LLM of InternVL2.5-1B): (in, out) of q k v o gate up down.
QWEN05_LINEARS = [(896, 896), (896, 128), (896, 128), (896, 896), (896, 4864), (896, 4864),
                  (4864, 896)]


def linear_bench(rounds: int, group_size: int = 128, device: str = "cpu") -> None:
    """Time one Qwen2-0.5B decoder layer's linears (random weights) per kind of weight, for a
    decode-sized batch (16 rows) and a prefill-sized one (2,048 rows). On CUDA the W4A16 row
    runs torch's tinygemm int4 kernel with bf16 activations and int8 dynamic (CPU only) is
    left out."""
    from vlmbatch.quant.int4 import rtn

    cuda = device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    w4 = "w4a16 (int4, bf16 act)"
    w4u = "w4, unpacked per call"  # the fallback: dequantise, then a dense matmul
    kinds: dict[str, list] = {"fp32": [], "bf16": [], w4: [], w4u: []}
    if not cuda:
        kinds["int8 dynamic"] = []
    act = {"bf16": torch.bfloat16, w4: torch.bfloat16 if cuda else torch.float32,
           w4u: torch.bfloat16 if cuda else torch.float32}
    for k, n in QWEN05_LINEARS:
        w = torch.randn(n, k, generator=g) * 0.02
        dense = torch.nn.Linear(k, n, bias=False)
        dense.weight.data.copy_(w)
        kinds["fp32"].append(dense.to(device))
        kinds["bf16"].append(torch.nn.Linear(k, n, bias=False).to(device, torch.bfloat16))
        kinds["bf16"][-1].weight.data.copy_(w)
        q, scale = rtn(w, group_size)
        kinds[w4].append(Int4Linear(q, scale, None, group_size, device, act[w4]))
        kinds[w4u].append(Int4Linear(q, scale, None, group_size, device, act[w4u],
                                     use_kernel=False))
        if not cuda:
            kinds["int8 dynamic"].append(torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(dense), {torch.nn.Linear}, dtype=torch.qint8))
    reps = 50 if cuda else 5
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} CPU threads"
    print(f"\nOne Qwen2-0.5B decoder layer's 7 linears (random weights), ms per call, best of "
          f"{rounds} interleaved rounds of {reps} calls, {where}; W4A16 kernel: "
          f"{kinds[w4][0].kernel}\n")
    print("| weights | bytes | 16 rows (decode) | 2,048 rows (prefill) |")
    print("|---|---|---|---|")
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, mods in kinds.items():
                for m in (16, 2048):
                    xs = [torch.randn(m, k, generator=g).to(device, act.get(name, torch.float32))
                          for k, _ in QWEN05_LINEARS]
                    for mod, t in zip(mods, xs):  # warm
                        mod(t)
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        for mod, t in zip(mods, xs):
                            mod(t)
                    if cuda:
                        torch.cuda.synchronize()
                    el = (time.perf_counter() - t0) / reps
                    best[(name, m)] = min(best.get((name, m), el), el)
    for name, mods in kinds.items():
        size = sum(llm_weight_bytes(m) for m in mods)
        cells = [f"{1e3 * best[(name, m)]:.3f} ({best[('fp32', m)] / best[(name, m)]:.2f}x)"
                 for m in (16, 2048)]
        print(f"| {name} | {size / 2**20:.1f} MiB | {cells[0]} | {cells[1]} |")


def rss_child(args: argparse.Namespace) -> None:
    """--rss-row: load one row, answer the QPM subset, print peak RSS (MiB)."""
    spec = json.loads(args.rss_row)
    row = Row(spec["name"], Path(spec["model"]), spec["llm_quant"], spec["vit"])
    answer(row, easy_vqa_set("test").items[: args.qpm_images])
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent
    # across fork + exec, so every child would report the benchmark's own peak.
    hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM:"))
    print(int(hwm.split()[1]) / 1024)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--limit", type=int, default=None, help="test questions (default all)")
    ap.add_argument("--calib-samples", type=int, default=256)
    ap.add_argument("--qpm-images", type=int, default=200, help="images timed for short QPM")
    ap.add_argument("--long-images", type=int, default=24, help="images timed for long QPM")
    ap.add_argument("--long-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-rss", dest="rss", action="store_false")
    ap.add_argument("--linears-only", action="store_true",
                    help="only the Qwen2-0.5B linear-layer timing")
    ap.add_argument("--device", default="cpu", help="--linears-only: cpu or cuda")
    ap.add_argument("--rss-row", help=argparse.SUPPRESS)
    return ap.parse_args()


def make_rows(args: argparse.Namespace) -> list[Row]:
    """fp32, the three W4A16 checkpoints (quantised here, timed), and the int8 rows."""
    tmp = Path(tempfile.mkdtemp(prefix="vlmbatch-quant-"))
    calib = easy_vqa_set("train", args.calib_samples).items
    rows = [Row("fp32", args.model)]
    for method in ("rtn", "awq", "gptq"):
        t0 = time.perf_counter()
        out = quantize_model(args.model, tmp / method, method, calib, args.calib_samples,
                             progress=False).out
        print(f"quantize {method}: {time.perf_counter() - t0:.1f}s", flush=True)
        rows.append(Row(method, out))
    return rows + [Row("llm-int8", args.model, llm_quant="int8-dynamic"),
                   Row("vit-fp32-ort", args.model, vit="onnxruntime"),
                   Row("vit-int8", args.model, vit="onnxruntime-int8")]


def measure_accuracy(rows: list[Row], limit: int | None) -> None:
    test = easy_vqa_set("test", limit)
    for row in rows:
        lines = answer(row, test.items)
        row.p_yes = [a.p_yes for a in lines]
        row.correct = sum(a.answer == test.expected[(a.image_id, a.question_id)]
                          for a in lines)
        llm = row.engine().model.llm
        row.weight_bytes = vit_bytes(row) if row.vit != "torch" else llm_weight_bytes(llm)
        kernels = {m.kernel for m in llm.modules() if isinstance(m, Int4Linear)}
        print(f"{row.name}: accuracy {row.correct / len(lines):.4f}"
              + (f" (int4 kernels: {sorted(kernels)})" if kernels else ""), flush=True)


def measure_qpm(rows: list[Row], args: argparse.Namespace) -> tuple[int, int]:
    """Best-of-``rounds`` QPM per row, short and long answers, rows interleaved in each
    round; peak RSS per row in a fresh process. Returns the question counts timed."""
    everything = easy_vqa_set("test").items
    short_items, long_items = everything[: args.qpm_images], everything[: args.long_images]
    n_short = sum(len(it.questions) for it in short_items)
    n_long = sum(len(it.questions) for it in long_items)
    for row in rows:  # warm-up (first-call costs) before timing
        answer(row, short_items[:4])
        answer(row, long_items[:2], args.long_tokens)
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for row in rows:
            for kind, items, tokens in (("short", short_items, 0),
                                        ("long", long_items, args.long_tokens)):
                t0 = time.perf_counter()
                answer(row, items, tokens)
                dt = time.perf_counter() - t0
                best[(row.name, kind)] = min(best.get((row.name, kind), dt), dt)
    for row in rows:
        row.short_qpm = 60 * n_short / best[(row.name, "short")]
        row.long_qpm = 60 * n_long / best[(row.name, "long")]
        if args.rss:
            spec = json.dumps({"name": row.name, "model": str(row.model),
                               "llm_quant": row.llm_quant, "vit": row.vit})
            out = subprocess.run([sys.executable, __file__, "--rss-row", spec, "--threads",
                                  str(args.threads), "--qpm-images", str(args.qpm_images)],
                                 capture_output=True, text=True, check=True)
            row.rss_mib = float(out.stdout.strip().splitlines()[-1])
    return n_short, n_long


def print_table(rows: list[Row], args: argparse.Namespace, n_short: int, n_long: int) -> None:
    ref = rows[0]
    n = len(ref.p_yes)
    print(f"\neasy-vqa test yes/no, {n} questions; calibration {args.calib_samples} train "
          f"questions; QPM short over {n_short} q ({args.qpm_images} images), long over "
          f"{n_long} q x {args.long_tokens} tokens; {args.threads} threads\n")
    print("| row | accuracy | Δ vs fp32 (points) | mean abs ΔP(yes) | weights | peak RSS | "
          "QPM short | QPM long |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        dp = sum(abs(a - b) for a, b in zip(row.p_yes, ref.p_yes)) / n
        what = "ViT" if row.vit != "torch" else "LLM"
        print(f"| {row.name} | {row.correct / n:.4f} | {100 * (row.correct - ref.correct) / n:+.2f}"
              f" | {dp:.4f} | {what} {row.weight_bytes / 2**20:.2f} MiB | "
              f"{row.rss_mib:.0f} MiB | {row.short_qpm:,.0f} ({row.short_qpm / ref.short_qpm:.2f}x)"
              f" | {row.long_qpm:,.0f} ({row.long_qpm / ref.long_qpm:.2f}x) |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_row:
        return rss_child(args)
    if args.linears_only:
        return linear_bench(args.rounds, device=args.device)
    rows = make_rows(args)
    measure_accuracy(rows, args.limit)
    print_table(rows, args, *measure_qpm(rows, args))
    linear_bench(args.rounds)


if __name__ == "__main__":
    main()
