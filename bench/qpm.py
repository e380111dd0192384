"""QPM benchmark: a transformers-style baseline vs vlmbatch, same questions, one process.

(a) baseline, written the way a transformers user would from InternVL's model card: per
    question, Pillow decode + ``dynamic_preprocess`` + ToTensor/Normalize, then one
    ``InternVLForConditionalGeneration`` forward (SDPA attention) on that single prompt;
    P(yes) from the last position's logits.
(b) vlmbatch without the prefix cache: ``jobs.runner.answer_group`` (OpenCV preprocessing,
    each image encoded once, batched prefill), the same path as ``vlmbatch run``;
(c) vlmbatch with the image-aware prefix cache (the default): an image's prefix is prefilled
    once and reused by its other questions;
(d) (c) with the vision encoder on onnxruntime (CPU; on CUDA only with onnxruntime-gpu);
(e) on CUDA, (c) with the vision encoder run eagerly instead of through the CUDA graph pool;
(f) on CUDA, (c) with ``max_batch_tokens`` 65,536 instead of 8,192 (fewer, larger forwards).

``--device cuda --dtype bfloat16`` runs every row, the baseline included, on the GPU
(bench/gpu_check.sh does).

Both answer the first ``--images`` images of easy-vqa's *test* split (all their yes/no
questions); the script prints QPM for each, the ratio, each one's accuracy and how often
they agree, plus the cache's block hit rate, LLM tokens prefilled per question and the
process's peak RSS after each path (the vlmbatch rows run first and the baseline last, though
it prints first, so each figure includes the paths run before it). Same thread count for all
(``--threads``). Not a test: timings on shared machines are noisy, so compare the rows of one
run, not runs across machines.

Each vlmbatch path first answers one untimed group of training images (graph capture,
allocator, kernel choice at the timed shapes); ``--rounds N`` times it N times, each with a fresh
engine (empty cache), and keeps the best; ``--profile DIR`` adds one profiled round per path.

    python bench/qpm.py --images 100
    python bench/qpm.py --images 500 --device cuda --dtype bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.prompt import PromptBuilder  # noqa: E402
from vit_trt.runners import make_runner  # noqa: E402

from pipeline.config import DEFAULT_MODEL, DTYPES, EngineConfig  # noqa: E402
from pipeline.drive import answer_group  # noqa: E402
from pipeline.evaluate import easy_vqa_items  # noqa: E402
from pipeline.loading import load_model  # noqa: E402
from pipeline.scoring import AnswerTokens  # noqa: E402
from pipeline.torch_engine import TorchEngine  # noqa: E402
from preprocessing.reference import pillow_tiles, pixel_values  # noqa: E402

BASELINE_PROMPT_LENS: list = []  # the baseline prefills every prompt token


def baseline(model_dir: Path, items: list, tok, answers: AnswerTokens,  # noqa: ANN001
             warm: list, device: str = "cpu", dtype: torch.dtype = torch.float32
             ) -> tuple[list, float]:
    from transformers import InternVLForConditionalGeneration

    ref = InternVLForConditionalGeneration.from_pretrained(
        str(model_dir), attn_implementation="sdpa").to(device, dtype).eval()
    spec = load_model(model_dir).spec
    t = spec.tiling
    yes, no = list(answers.yes_ids), list(answers.no_ids)
    prompts = PromptBuilder(tok, spec.tokens_per_tile, spec.image_token_id)
    def answer(item_list: list) -> list[float]:
        out = []
        with torch.inference_mode():
            for item in item_list:
                for q in item.questions:
                    data = Path(item.image).read_bytes()  # per question, as a naive loop does
                    tiles = pillow_tiles(data, t.tile_size, t.min_tiles, t.max_tiles)
                    pv = pixel_values(tiles, spec.vision.mean, spec.vision.std)
                    ids = torch.tensor([prompts.build(q.text, len(tiles)).ids])
                    BASELINE_PROMPT_LENS.append(ids[0])
                    logits = ref(input_ids=ids.to(device),
                                 pixel_values=pv.to(device, dtype)).logits[0, -1].float()
                    out.append(float(torch.sigmoid(logits[yes].logsumexp(-1)
                                                   - logits[no].logsumexp(-1))))
        return out

    answer(warm)
    BASELINE_PROMPT_LENS.clear()
    start = time.perf_counter()
    out = answer(items)
    return out, time.perf_counter() - start


def ours(model_dir: Path, items: list, images_per_batch: int, cache: bool, warm: list,
         vit: str = "torch", device: str = "cpu", dtype: torch.dtype = torch.float32,
         graphs: bool = True, rounds: int = 1, profile: Path | None = None,
         engine_kw: dict | None = None) -> tuple[list, float, TorchEngine]:
    """Answers ``items`` in groups; returns P(yes), the best of ``rounds`` timings (each round a
    fresh engine: empty cache, zeroed counters) and the last round's engine. ``warm`` is
    answered first, untimed, in groups of the same size (shapes, allocator, graph capture)."""
    model = load_model(model_dir, device, dtype)
    tiling = model.spec.tiling
    runner = make_runner(vit, model, device, cuda_graphs=graphs, stream_ordered=True)  # as `run`
    cfg = EngineConfig(prefix_cache=cache, cuda_graphs=graphs, **(engine_kw or {}))

    def run(engine: TorchEngine, its: list) -> list:
        out = []
        for g in range(0, len(its), images_per_batch):
            group = its[g: g + images_per_batch]
            out += [ln["p_yes"] for ln in answer_group(engine, tiling, group)]
        return out

    run(TorchEngine(model, cfg, runner), warm)
    best = float("inf")
    for _ in range(rounds):
        engine = TorchEngine(model, cfg, runner)
        start = time.perf_counter()
        out = run(engine, items)
        best = min(best, time.perf_counter() - start)
    if profile is not None:
        write_profile(profile, lambda: run(TorchEngine(model, cfg, runner), items))
    return out, best, engine


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
    text = buf.getvalue() + "\n" + avg.table(sort_by="self_cpu_time_total", row_limit=25)
    if torch.cuda.is_available():
        text += "\n" + avg.table(sort_by="self_cuda_time_total", row_limit=15)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"profile: {path}")


def ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--images", type=int, default=100, help="first N easy-vqa test images")
    ap.add_argument("--images-per-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every row, baseline too)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds per vlmbatch path, best kept (the baseline runs once)")
    ap.add_argument("--random-shape", choices=["internvl3-1b"], default=None,
                    help="answer with a random-weight model of this shape instead of --model "
                    "(speed at real size; accuracy then means nothing): built in a temporary "
                    "folder, saved in --dtype")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="also write a torch.profiler table per vlmbatch path into DIR")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cuda = args.device.startswith("cuda")

    if args.random_shape:
        from models.internvl.random import INTERNVL3_1B, save_random_internvl

        tmp = tempfile.TemporaryDirectory(prefix="vlmbatch-random-")
        t0 = time.perf_counter()
        args.model = save_random_internvl(Path(tmp.name), dtype=dtype, **INTERNVL3_1B)  # type: ignore[arg-type]
        print(f"random {args.random_shape} saved in {time.perf_counter() - t0:.0f} s")
    items = easy_vqa_items("test")[: args.images]
    # untimed warm-up for every path, one group: the shapes the timed groups have
    warm = easy_vqa_items("train")[: args.images_per_batch]
    truth = [q.id.split(":")[1] for it in items for q in it.questions]
    n = len(truth)
    tok = load_model(args.model).tokenizer
    answers = AnswerTokens.from_words(tok, EngineConfig().yes_words, EngineConfig().no_words)

    rows = []
    paths: list[tuple] = [("vlmbatch, no prefix cache", False, "torch", True, {}),
                          ("vlmbatch, prefix cache", True, "torch", True, {})]
    if cuda:
        paths.append(("vlmbatch, cache, eager ViT", True, "torch", False, {}))
        # batches 8x the default's tokens: fewer forwards, fewer launches and gathers
        paths.append(("vlmbatch, cache, 64k batches", True, "torch", True,
                      {"max_batch_tokens": 65536}))
    if importlib.util.find_spec("onnxruntime") is not None and (not cuda or ort_cuda()):
        paths.append(("vlmbatch, cache, ORT ViT", True, "onnxruntime", True, {}))
    for name, cache, vit, graphs, kw in paths:
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
        ps, secs, eng = ours(args.model, items, args.images_per_batch, cache, warm, vit,
                             args.device, dtype, graphs, args.rounds,
                             args.profile / f"profile-{slug}.txt" if args.profile else None, kw)
        hit = f"{eng.cache.stats.hit_rate():.2f}" if eng.cache is not None else "-"
        rows.append((name, secs, ps, hit, eng.stats.prefill_tokens / n, peak_rss_mib()))
    p_base, t_base = baseline(args.model, items, tok, answers, warm[:4], args.device, dtype)
    rows.insert(0, ("baseline (transformers)", t_base, p_base, "-",
                    sum(len(p) for p in BASELINE_PROMPT_LENS) / n, peak_rss_mib()))

    def acc(ps: list) -> float:
        return sum(("yes" if p >= 0.5 else "no") == a for p, a in zip(ps, truth)) / n

    where = (torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads")
    print(f"easy-vqa test: {len(items)} images, {n} yes/no questions, {where}, {args.dtype}, "
          f"model {args.model.name}")
    print(f"{'path':<28}{'seconds':>9}{'QPM':>9}{'x base':>8}{'accuracy':>10}{'agree':>8}"
          f"{'hit rate':>10}{'prefill/q':>11}{'peak RSS MiB':>14}")
    for name, secs, ps, hit, per_q, rss in rows:
        agree = sum((a >= 0.5) == (b >= 0.5) for a, b in zip(ps, p_base)) / n
        print(f"{name:<28}{secs:>9.2f}{60 * n / secs:>9.0f}{t_base / secs:>8.2f}"
              f"{acc(ps):>10.4f}{agree:>8.4f}{hit:>10}{per_q:>11.1f}{rss:>14.0f}")
    max_dp = max(abs(a - b) for a, b in zip(rows[2][2], p_base))
    print(f"max |dP(yes)| vlmbatch (cache) vs baseline: {max_dp:.4f} "
          "(OpenCV vs Pillow resize; the models are the same)")


if __name__ == "__main__":
    main()
