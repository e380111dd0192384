"""QPM benchmark: transformers baselines vs vlmbatch, same questions, one process.

(a) batched transformers (the headline ratio, "x batched"), what a competent transformers user
    writes (``vlmbatch/cli/bench/baseline.py``, as ``vlmbatch bench --baseline transformers``):
    ``InternVLForConditionalGeneration`` on SDPA, Pillow tiles made once per image (the model card's
    path), ``--baseline-batch`` prompts per forward, left-padded, P(yes) from each row's last real
    token; each image's features computed once and passed back for all its questions
    (``mm_encoder_outputs``, a forward argument of transformers 5), or with ``--baseline-vit
    per-prompt`` its pixel values passed per prompt (the vision tower run per question). The bench
    checks that its P(yes) equals (a')'s within ``--check-tol`` (1e-4) in fp32, prints the check,
    and exits 1 after the tables when it fails (the reason on stderr);
(a') per-question transformers ("x per-q"), the naive loop: per question, Pillow decode +
    ``dynamic_preprocess`` + ToTensor/Normalize, then one forward on that single prompt.

The vlmbatch rows are ``vlmbatch bench``'s (``cli/bench/measure.py``: ``EngineRow``,
``timed_rounds``), with their prefill calls recorded for the FLOP table:

(b) vlmbatch without the prefix cache: ``pipeline.drive.answer_group`` (OpenCV preprocessing,
    each image encoded once, batched prefill), the same path as ``vlmbatch run``;
(c) vlmbatch with the image-aware prefix cache (the default): an image's prefix is prefilled
    once and reused by its other questions;
(c') on the CPU, (c) with ``question_rows="on"`` (an image's prefix and its questions in one
    row, one forward per step: the default on CUDA, ``engine/packing.py``);
(d) (c) with the vision encoder on onnxruntime (CPU; on CUDA only with onnxruntime-gpu);
(e) on CUDA, (c) with the vision encoder run eagerly instead of through the CUDA graph pool;
(f) on CUDA, (c) with ``max_batch_tokens`` 65,536 instead of 8,192 (fewer, larger forwards).

``--device cuda --dtype bfloat16`` runs every row, the baselines included, on the GPU
(bench/gpu_check.sh does).

A Qwen-VL model (``--model DIR``, or ``--random-shape qwen2.5-vl-3b|qwen3-vl-2b``: random
weights at those checkpoints' sizes, ``models/qwen_vl/random.py``) gets the same rows but
(d), with the baselines of ``vlmbatch/cli/bench/baseline_qwen.py`` (image processor pixels,
the tower run per prompt in the batched one) and no FLOP table.

FLOPs (``bench/flops.py``): per row, the model FLOPs of what that path computed (vision tiles
it encoded, LLM tokens it prefilled after what it had cached; padding not counted, causal
attention), per question and per second, and with ``--peak-tflops`` (790 by default on CUDA:
the H200's measured bf16 matrix rate; none on the CPU) the fraction of that peak.

All rows answer the first ``--images`` images of easy-vqa's *test* split (all their yes/no
questions); the script prints QPM for each, the ratios, each one's accuracy and how often
they agree with batched transformers, plus the cache's block hit rate, LLM tokens prefilled
per question and the process's peak RSS after each row's set-up and warm-up (vlmbatch rows
first, then the transformers model, so each figure includes the rows set up before it).
Same thread count for all (``--threads``). Not a test: timings on shared machines are noisy,
so compare the rows of one run, not runs across machines.

Every row but the per-question baseline first answers one untimed group of training images
(graph capture, allocator, kernel choice at the timed shapes). ``--rounds N`` then times N
rounds of each, interleaved (round 1 of every row, then round 2, the order rotated), each
vlmbatch round with a fresh engine (empty cache), and keeps each row's best: a slow spell of
a shared machine then lands on every row, not on one. The per-question baseline warms on 4
images and runs once, last (it is the slow one). ``--profile DIR`` adds one profiled round
per vlmbatch path.

    python bench/qpm.py --images 60 --rounds 3
    python bench/qpm.py --images 500 --device cuda --dtype bfloat16 --rounds 3
    python bench/qpm.py --images 60 --rounds 3 --before /tmp/before   # today's code beside
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checks import Checks  # noqa: E402
from bench.flops import workload_flops  # noqa: E402
from vlmbatch.cli.bench.baseline import Batched, Work, load_reference, per_question  # noqa: E402
from vlmbatch.cli.bench.baseline_qwen import QwenBatched, load_qwen_reference, qwen_per_question  # noqa: E402
from vlmbatch.cli.bench.config import parse_sizes  # noqa: E402
from vlmbatch.cli.bench.measure import EngineRow, peak_rss_mib, timed_rounds  # noqa: E402
from vlmbatch.cli.bench.scenes import scene_set  # noqa: E402
from vlmbatch.cli.evaluate import easy_vqa_set  # noqa: E402
from vlmbatch.engine.config import DTYPES, EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.engine.loading import load_model, torch_dtype  # noqa: E402
from vlmbatch.engine.scoring import AnswerTokens  # noqa: E402
from vlmbatch.engine.torch_engine import TorchEngine, load_configured  # noqa: E402
from vlmbatch.models.internvl.random import SHAPES, save_random_internvl  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402
from vlmbatch.models.qwen_vl.random import SHAPES as QWEN_SHAPES  # noqa: E402
from vlmbatch.models.qwen_vl.random import save_random_qwen_vl  # noqa: E402


def _record_prefills(model) -> list:  # noqa: ANN001
    """Wrap ``model.llm.prefill`` and ``prefill_segments`` (an image's prefix and questions
    in one row) to keep each call's (new tokens per row, past_lengths) tensors, as they are
    (no read-back, so no host wait on CUDA): the work of a round, for its FLOPs."""
    calls: list = []
    inner, rows = model.llm.prefill, model.llm.prefill_segments

    def prefill(embeds, lengths, past=None, past_lengths=None, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append((lengths, past_lengths))
        return inner(embeds, lengths, past, past_lengths, **kw)

    def prefill_segments(embeds, positions, segments, at, past=None, past_lengths=None,  # noqa: ANN001, ANN202
                         **kw):  # noqa: ANN003
        calls.append(((segments >= 0).sum(1), past_lengths))
        return rows(embeds, positions, segments, at, past, past_lengths, **kw)

    model.llm.prefill, model.llm.prefill_segments = prefill, prefill_segments
    return calls


def _work(engine: TorchEngine, calls: list) -> Work:
    """A round's work from its engine's counters and the recorded prefill calls."""
    prefills = []
    for lengths, past in calls:
        new = lengths.tolist()
        prefills += zip(new, past.tolist() if past is not None else [0] * len(new))
    return Work(engine.stats.vision_tiles, prefills)


class VlmbatchPath(EngineRow):
    """One vlmbatch row: ``vlmbatch bench``'s row (``cli/bench/measure.py``: warmed up at
    construction, ``round()`` with a fresh engine) on its own load of the model, whose
    prefill calls are recorded for the round's work (FLOPs)."""

    def __init__(self, name: str, model_dir: Path, items: list, images_per_batch: int,
                 cache: bool, warm: list, vit: str = "torch", device: str = "cpu",
                 dtype: str = "float32", graphs: bool = True,
                 engine_kw: dict | None = None, quant: str = "none") -> None:
        model_cfg = ModelConfig(model_dir, device, dtype, quant=quant)
        model = load_configured(model_cfg)  # fused, as `run` loads it
        self.calls = _record_prefills(model)
        super().__init__(name, model, model_cfg, EngineConfig(
            prefix_cache=cache, cuda_graphs=graphs, vit_backend=vit, **(engine_kw or {})),
            items, images_per_batch, warm)

    def round(self) -> None:
        self.calls.clear()
        super().round()
        self.work = _work(self.last_engine, self.calls)

    def profile(self, path: Path) -> None:
        write_profile(path, lambda: self.answer(self.engine(), self.items))


class TreeRow:
    """A vlmbatch row answered by another checkout of the code (``--before DIR``): a
    ``bench/qpm_row.py`` worker under ``PYTHONPATH=DIR``, warmed up at construction,
    timed round for round with the rows of this process (``round()``: a fresh engine)."""

    def __init__(self, name: str, tree: Path, args: argparse.Namespace, cache: bool) -> None:
        import json
        import os
        import subprocess

        self.name, self.times, self._json = name, [], json
        cmd = [sys.executable, str(Path(__file__).with_name("qpm_row.py")), "--images",
               str(args.images), "--images-per-batch", str(args.images_per_batch), "--cache",
               str(int(cache)), "--threads", str(args.threads), "--device", args.device,
               "--dtype", args.dtype]
        if args.model != DEFAULT_MODEL:
            cmd += ["--model", str(args.model)]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(tree)},
                                     cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._read()  # ready
        self.rss = float("nan")

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the worker exited ({self.proc.wait()})")
        return self._json.loads(line)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def round(self) -> None:
        self._send("round")
        self.times.append(self._read()["seconds"])

    def finish(self) -> None:
        self._send("quit")
        out = self._read()
        self.proc.wait()
        self.p_yes, self.hit, self.prefill_tokens = (out["p_yes"], out["hit_rate"],
                                                     out["prefill_tokens"])


def write_profile(path: Path, fn) -> None:  # noqa: ANN001
    """Two more rounds: one under cProfile (where the host's time goes: Python, and waits on
    the GPU), one under torch.profiler (top ops by self CPU time and by device time)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof_py = cProfile.Profile()
    prof_py.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof_py, stream=buf).sort_stats("tottime").print_stats(30)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    avg = prof.key_averages()
    # what the host dispatches per round: CUDA kernel launches on a GPU, aten ops on the CPU
    cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    counts = (f"CUDA kernels per round: {len(cuda)}; " if cuda else "") + \
        f"aten ops per round: {ops}"
    print(f"profile {path.name}: {counts}")
    text = counts + "\n" + buf.getvalue() + "\n" + avg.table(sort_by="self_cpu_time_total",
                                                               row_limit=25)
    if torch.cuda.is_available():
        text += "\n" + avg.table(sort_by="self_cuda_time_total", row_limit=15)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"profile: {path}")


def ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--images", type=int, default=100, help="first N easy-vqa test images")
    ap.add_argument("--images-per-batch", type=int, default=16)
    ap.add_argument("--baseline-batch", type=int, default=16,
                    help="prompts per forward of the batched transformers baseline")
    ap.add_argument("--baseline-vit", choices=["once", "per-prompt"], default="once",
                    help="batched baseline: each image's features computed once and passed "
                    "back (mm_encoder_outputs), or its pixel values passed per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every row, baselines too)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds per vlmbatch path and for the batched baseline, best "
                    "kept (the per-question baseline runs once)")
    ap.add_argument("--random-shape", choices=[*SHAPES, *QWEN_SHAPES], default=None,
                    help="answer with a random-weight model of this shape instead of --model "
                    "(speed at real size; accuracy then means nothing): built in a temporary "
                    "folder, saved in --dtype (8b: ~16 GB on disk in bf16, ~50 GB of host "
                    "memory while it is built)")
    ap.add_argument("--scene-sizes", default=None, metavar="WxH,...",
                    help="instead of easy-vqa's 64 px images: --images shape scenes cycling "
                    "through these sizes (448x448,896x672,1344x896: 1-12 tiles), each asked "
                    "--questions-per-image questions")
    ap.add_argument("--questions-per-image", type=int, default=6,
                    help="with --scene-sizes: questions per scene (default 6)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOP/s for the fraction column (default: 790 on CUDA, the "
                    "H200's measured bf16 matrix rate; none on the CPU)")
    ap.add_argument("--fp8", action="store_true",
                    help="add a row with --quant fp8 (decoder and ViT linears W8A8 e4m3)")
    ap.add_argument("--compile-vit", action="store_true",
                    help="add a row with --vit-backend compile (torch.compile per bucket)")
    ap.add_argument("--compile-llm", action="store_true",
                    help="add a row with --compile-llm (torch.compile of the prefill)")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="also write a torch.profiler table per vlmbatch path into DIR")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="also time the two vlmbatch rows (prefix cache on and off) with "
                    "another checkout of the code (bench/qpm_row.py workers, PYTHONPATH=DIR), "
                    "round for round with this one, and print this tree's / that one's")
    ap.add_argument("--check-tol", type=float, default=1e-4,
                    help="fp32 bound on |batched - per-question transformers P(yes)|; the run "
                    "exits 1 past it (default 1e-4)")
    args = ap.parse_args()
    if args.peak_tflops is None and args.device.startswith("cuda"):
        args.peak_tflops = 790.0
    return args


def vlmbatch_paths(args: argparse.Namespace, items: list, warm: list,
                   packed: bool = False) -> list[VlmbatchPath]:
    """The vlmbatch rows; no onnxruntime row for a packed model (Qwen-VL), which only the
    torch runner runs."""
    cuda = args.device.startswith("cuda")
    paths: list[tuple] = [("vlmbatch, no prefix cache", False, "torch", True, {}),
                          ("vlmbatch, prefix cache", True, "torch", True, {})]
    if not cuda:  # on CUDA the default; on the CPU: what an image's questions in one row cost
        paths.append(("vlmbatch, cache, question rows", True, "torch", True,
                      {"question_rows": "on"}))
    if cuda:
        paths.append(("vlmbatch, cache, eager ViT", True, "torch", False, {}))
        # batches 8x the default's tokens: fewer forwards, fewer launches and gathers
        paths.append(("vlmbatch, cache, 64k batches", True, "torch", True,
                      {"max_batch_tokens": 65536}))
    if (not packed and importlib.util.find_spec("onnxruntime") is not None
            and (not cuda or ort_cuda())):
        paths.append(("vlmbatch, cache, ORT ViT", True, "onnxruntime", True, {}))
    if args.compile_vit:
        paths.append(("vlmbatch, cache, compiled ViT", True, "compile", True, {}))
    if args.compile_llm:  # torch.compile of the decoder's prefill (its first calls compile)
        paths.append(("vlmbatch, cache, compiled LLM", True, "torch", True,
                      {"compile_llm": True}))
    made = [VlmbatchPath(name, args.model, items, args.images_per_batch, cache, warm, vit,
                         args.device, args.dtype, graphs, kw)
            for name, cache, vit, graphs, kw in paths]
    if args.fp8:  # W8A8 e4m3 linears; on the CPU the (slow) reference of the GPU's arithmetic
        made.append(VlmbatchPath("vlmbatch, cache, fp8", args.model, items,
                                 args.images_per_batch, True, warm, "torch", args.device,
                                 args.dtype, True, {}, quant="fp8"))
    return made


def timed_rows(args: argparse.Namespace, items: list, warm: list, dtype: torch.dtype,
               n: int, host) -> tuple[list[tuple], str]:  # noqa: ANN001
    """Every row as (name, seconds, p_yes, hit rate, prefill tokens per question, work,
    peak RSS), batched transformers first; and how that row ran its vision tower.

    The timed rounds are interleaved: round r of every row, then round r + 1, the order
    rotated each round, so that a slow spell on a shared machine is spread over the rows
    instead of landing on one; each row keeps its best. The per-question baseline runs once,
    last (it is the slow one)."""
    spec, tok, prompts = host.spec, host.tokenizer, host.prompts
    answers = AnswerTokens.from_words(tok, EngineConfig().yes_words, EngineConfig().no_words)
    qwen = host.family.packed_vision
    ours = vlmbatch_paths(args, items, warm, qwen)
    ref = (load_qwen_reference if qwen else load_reference)(args.model, args.device, dtype)
    b = (QwenBatched(ref, spec, prompts, answers, items, warm, args.baseline_batch,
                     tok.pad_token_id or 0) if qwen else
         Batched(ref, spec, prompts, answers, items, warm, args.baseline_batch,
                 args.baseline_vit == "once", tok.pad_token_id or 0))
    rss_b = peak_rss_mib()
    before = [] if args.before is None else [
        TreeRow(f"before: {name}", args.before.resolve(), args, cache)
        for name, cache in (("vlmbatch, no prefix cache", False),
                            ("vlmbatch, prefix cache", True))]
    timed: list = [b, *ours, *before]
    timed_rounds(timed, args.rounds)
    if args.profile is not None:
        for path in ours:
            slug = "".join(c if c.isalnum() else "-" for c in path.name).strip("-")
            path.profile(args.profile / f"profile-{slug}.txt")
    q = (qwen_per_question if qwen else per_question)(ref, spec, prompts, answers, items,
                                                      warm[:4])
    rows = []
    for name, r, rss in (("transformers, batched", b.result(), rss_b),
                         ("transformers, per question", q, peak_rss_mib())):
        per_q = sum(t for t, _ in r.work.prefills) / n
        rows.append((name, r.seconds, r.p_yes, "-", per_q, r.work, rss))
    for path in ours:
        eng = path.last_engine
        hit = f"{eng.cache.stats.hit_rate():.2f}" if eng.cache is not None else "-"
        rows.append((path.name, min(path.times), path.p_yes, hit, eng.stats.prefill_tokens / n,
                     path.work, path.rss))
    for tree in before:
        tree.finish()
        hit = "-" if tree.hit is None else f"{tree.hit:.2f}"
        rows.append((tree.name, min(tree.times), tree.p_yes, hit, tree.prefill_tokens / n,
                     None, tree.rss))
    return rows, b.vision


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    cuda = args.device.startswith("cuda")

    if args.random_shape:
        tmp = tempfile.TemporaryDirectory(prefix="vlmbatch-random-")
        t0 = time.perf_counter()
        if args.random_shape in SHAPES:
            args.model = save_random_internvl(Path(tmp.name), dtype=dtype,
                                              **SHAPES[args.random_shape])  # type: ignore[arg-type]
        else:  # sizes of the released checkpoint (models/qwen_vl/random.py)
            args.model = save_random_qwen_vl(Path(tmp.name), dtype=dtype,
                                             **QWEN_SHAPES[args.random_shape])
        print(f"random {args.random_shape} saved in {time.perf_counter() - t0:.0f} s")
    if args.scene_sizes:
        folder = tempfile.TemporaryDirectory(prefix="vlmbatch-scenes-")
        sizes = parse_sizes(args.scene_sizes)
        data = scene_set(sizes, -(-args.images // len(sizes)), args.questions_per_image,
                         Path(folder.name))
        warm_dir = Path(folder.name) / "warm"  # other scenes of the same sizes
        warm_dir.mkdir()
        warm = scene_set(sizes, -(-args.images_per_batch // len(sizes)),
                         args.questions_per_image, warm_dir, seed=7).items[: args.images_per_batch]
    else:  # untimed warm-up for every path, one group: the shapes the timed groups have
        data = easy_vqa_set("test")
        warm = easy_vqa_set("train").items[: args.images_per_batch]
    items = data.items[: args.images]
    truth = [data.expected[(it.id, q.id)] for it in items for q in it.questions]
    n = len(truth)
    host = load_model(args.model)  # spec and tokenizer
    rows, how = timed_rows(args, items, warm, dtype, n, host)
    where = (torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads")
    what = f"scenes {args.scene_sizes}" if args.scene_sizes else "easy-vqa test"
    print(f"{what}: {len(items)} images, {n} yes/no questions, {where}, {args.dtype}, "
          f"model {args.model.name}; batched baseline: {args.baseline_batch} prompts per "
          f"forward, {how}")
    print_table(rows, truth, host.spec, args.peak_tflops)
    print_checks(rows, args.dtype, args.check_tol).exit()


def print_table(rows: list[tuple], truth: list[str], spec,  # noqa: ANN001
                peak: float | None) -> None:
    n = len(truth)
    t_b, p_b = rows[0][1], rows[0][2]
    t_q = rows[1][1]

    def acc(ps: list) -> float:
        return sum(("yes" if p >= 0.5 else "no") == a for p, a in zip(ps, truth)) / n

    print(f"{'path':<28}{'seconds':>9}{'QPM':>9}{'x batched':>10}{'x per-q':>9}{'accuracy':>10}"
          f"{'agree':>8}{'hit rate':>10}{'prefill/q':>11}{'peak RSS MiB':>14}")
    for name, secs, ps, hit, per_q, _, rss in rows:
        agree = sum((a >= 0.5) == (b >= 0.5) for a, b in zip(ps, p_b)) / n
        print(f"{name:<28}{secs:>9.2f}{60 * n / secs:>9.0f}{t_b / secs:>10.2f}{t_q / secs:>9.2f}"
              f"{acc(ps):>10.4f}{agree:>8.4f}{hit:>10}{per_q:>11.1f}{rss:>14.0f}")
    if spec.model_type != "internvl":
        print("\nno FLOP table: bench/flops.py counts InternVL's tower and decoder only")
        return
    print(f"\nmodel FLOPs (bench/flops.py: matmuls, causal attention, no padding); "
          f"peak {f'{peak:g} TFLOP/s' if peak else 'not given (--peak-tflops)'}")
    print(f"{'path':<28}{'vision tiles':>13}{'LLM tokens':>12}{'GFLOP/q':>10}{'TFLOP/s':>10}"
          f"{'of peak':>9}")
    for name, secs, _, _, _, work, _ in rows:
        if work is None:  # another tree's row: its work is not recorded here
            continue
        flops = workload_flops(spec, work.vision_tiles, work.prefills)
        rate = flops / secs / 1e12
        frac = f"{rate / peak:.2%}" if peak else "-"
        print(f"{name:<28}{work.vision_tiles:>13}{sum(t for t, _ in work.prefills):>12}"
              f"{flops / n / 1e9:>10.3f}{rate:>10.4f}{frac:>9}")


def print_checks(rows: list[tuple], dtype: str, tol: float) -> Checks:
    checks = Checks()
    p_b, p_q = rows[0][2], rows[1][2]
    d = max(abs(a - b) for a, b in zip(p_b, p_q))
    what = (f"batched transformers P(yes) = per-question transformers P(yes) within {tol:g}: "
            f"max |dP(yes)| = {d:.2e}")
    verdict = checks.verdict(d <= tol, what) if dtype == "float32" else "(bound is for fp32)"
    print(f"\ncheck: {what} {verdict}")
    cache = next(r for r in rows if r[0] == "vlmbatch, prefix cache")
    max_dp = max(abs(a - b) for a, b in zip(cache[2], p_b))
    print(f"max |dP(yes)| vlmbatch (cache) vs batched transformers: {max_dp:.4f} "
          "(OpenCV vs Pillow resize; the models are the same)")
    for name in ("vlmbatch, prefix cache", "vlmbatch, no prefix cache"):
        old = next((r for r in rows if r[0] == f"before: {name}"), None)
        if old is not None:
            new = next(r for r in rows if r[0] == name)
            d = max(abs(a - b) for a, b in zip(new[2], old[2]))
            print(f"{name}: this tree {old[1] / new[1]:.2f}x the other's QPM "
                  f"({60 * len(new[2]) / new[1]:.0f} vs {60 * len(old[2]) / old[1]:.0f}); "
                  f"max |dP(yes)| between them {d:.2e}")
    return checks


if __name__ == "__main__":
    main()
