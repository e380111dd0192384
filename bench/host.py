"""Host cost per question: torch ops dispatched, Python calls and wall time of ``VLM.ask_many``
over easy-vqa test images (all their questions, ~7 per image), and torch ops per decoder and
per vision layer; for this tree and, with ``--before DIR``, another checkout of the code
(e.g. ``git worktree add /tmp/before main``) beside it in the same run, with the ratio.

Models (``--shapes``):

- ``builtin``: the built-in model (``vlmbatch/models/default_model``);
- ``internvl3-1b-narrow``: InternVL3-1B's topology with narrow widths, random weights built
  here (no download): 24 InternViT layers at 448 px tiles of 14 px patches, 256 image tokens
  per tile, 24 Qwen2 decoder layers with grouped KV heads; hidden sizes 64, so the arithmetic
  is small and what is left is the host's cost per op and per call.

The engine runs the path a GPU runs (``question_rows="on"``: an image's prefix and its
questions in one row; on a CPU ``auto`` keeps the phases, which compute less:
``--question-rows auto`` counts those), where the tree has that choice.

Each tree runs in its own subprocess (``PYTHONPATH`` = the tree; the worker is this file, so
both trees are measured by the same code). A worker builds a ``VLM`` (1 torch thread by
default, images decoded in decoder processes as ``run`` does), answers one untimed group of
easy-vqa *train* images (warm-up), then answers the same test images four times, each with an
emptied prefix cache (the first call of a job): timed; under ``torch.profiler`` (top-level
``aten::`` ops, i.e. those not called by another aten op: what the host dispatches); under
``cProfile`` (every thread of the answering process: one profiler per thread, total calls);
and once more timed. Per layer: the profiled run's top-level aten ops inside the first
decoder layer's and the first vision layer's calls, divided by their calls.

Counts do not depend on the machine's load; wall times do (the load average is printed).
The answers of the two trees are compared (max |dP(yes)|).

    python bench/host.py --before /tmp/before
    python bench/host.py --shapes internvl3-1b-narrow --images 32 --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("builtin", "internvl3-1b-narrow")

# InternVL3-1B's topology (models/internvl/random.py INTERNVL3_1B: its layer counts, tile,
# patch and heads' grouping) at narrow widths
NARROW_WIDTHS = dict(vision=dict(hidden_size=64, num_attention_heads=4, intermediate_size=128),
                     text=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128))


# --- the worker (runs in the tree under test) ---------------------------------------------

def _layer_lists(module):  # noqa: ANN001, ANN202
    """The first ``nn.ModuleList`` named ``layers`` or ``blocks`` under ``module``."""
    for name, sub in module.named_modules():
        if name.split(".")[-1] in ("layers", "blocks") and len(sub):
            return sub
    raise ValueError(f"no layer list in {type(module).__name__}")


def _mark(layer, label: str):  # noqa: ANN001, ANN202
    """Hooks that wrap each call of ``layer`` in a profiler range named ``label``."""
    import torch

    ranges: list = []

    def pre(*_):  # noqa: ANN002, ANN202
        r = torch.profiler.record_function(label)
        r.__enter__()
        ranges.append(r)

    def post(*_):  # noqa: ANN002, ANN202
        ranges.pop().__exit__(None, None, None)

    return [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]


def _aten_counts(events, labels: tuple[str, ...]) -> tuple[int, dict[str, float]]:  # noqa: ANN001
    """(top-level aten ops in all, per label: top-level aten ops per call of that range)."""
    total = 0
    inside = dict.fromkeys(labels, 0)
    calls = dict.fromkeys(labels, 0)
    for e in events:
        if e.name in calls:
            calls[e.name] += 1
        if not e.name.startswith("aten::"):
            continue
        parent, top, label = e.cpu_parent, True, None
        while parent is not None:
            if parent.name.startswith("aten::"):
                top = False
                break
            if parent.name in calls and label is None:
                label = parent.name
            parent = parent.cpu_parent
        if top:
            total += 1
            if label is not None:
                inside[label] += 1
    return total, {k: inside[k] / calls[k] if calls[k] else float("nan") for k in labels}


def _python_calls(fn) -> int:  # noqa: ANN001
    """Total calls (cProfile's count: Python and built-in functions) while ``fn`` runs, in
    this thread and in every thread started meanwhile (a profiler enabled in each)."""
    import cProfile
    import pstats
    import threading

    profs: list = []

    def start_in_thread(*_):  # noqa: ANN002, ANN202
        sys.setprofile(None)
        p = cProfile.Profile()
        profs.append(p)
        p.enable()

    threading.setprofile(start_in_thread)
    main = cProfile.Profile()
    try:
        main.runcall(fn)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    total = pstats.Stats(main).total_calls
    for p in profs:
        p.disable()  # the thread's own profiler keeps what it counted
        total += pstats.Stats(p).total_calls
    return total


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vlmbatch.api.vlm import VLM
    from vlmbatch.cli.evaluate import easy_vqa_set

    torch.set_num_threads(args.threads)
    import dataclasses

    from vlmbatch.engine.config import EngineConfig
    options = {}  # the path a GPU runs (``question_rows``), where the tree has the choice
    if "question_rows" in {f.name for f in dataclasses.fields(EngineConfig)}:
        options["question_rows"] = args.question_rows
    vlm = VLM(args.model, threads=args.threads, **options)
    engine = vlm.engine
    items = easy_vqa_set("test").items[: args.images]
    warm = easy_vqa_set("train").items[: args.warm]

    def answer(its: list) -> list[float]:
        if engine.cache is not None:
            engine.cache.clear()  # the first call of a job: nothing cached
        return [a.p_yes for a in vlm.ask_many(its)]

    answer(warm)
    t0 = time.perf_counter()
    p_yes = answer(items)
    walls = [time.perf_counter() - t0]
    hooks = (_mark(_layer_lists(engine.model.llm)[0], "host.decoder_layer")
             + _mark(_layer_lists(engine.model.vision)[0], "host.vision_layer"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        answer(items)
    for h in hooks:
        h.remove()
    ops, per_layer = _aten_counts(prof.events(), ("host.decoder_layer", "host.vision_layer"))
    calls = _python_calls(lambda: answer(items))
    t0 = time.perf_counter()
    answer(items)
    walls.append(time.perf_counter() - t0)
    vlm.close()
    print(json.dumps({"questions": len(p_yes), "ops": ops, "calls": calls,
                      "wall_s": min(walls), "decoder_layer_ops": per_layer["host.decoder_layer"],
                      "vision_layer_ops": per_layer["host.vision_layer"], "p_yes": p_yes}))


# --- the driver ---------------------------------------------------------------------------

def run_tree(tree: Path, model: Path | None, args: argparse.Namespace) -> dict:
    """One worker on ``tree``'s code; its JSON line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--images",
           str(args.images), "--threads", str(args.threads), "--warm", str(args.warm),
           "--question-rows", args.question_rows]
    if model is not None:
        cmd += ["--model", str(model)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"worker on {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def narrow_model(folder: Path) -> Path:
    """InternVL3-1B's topology at narrow widths, random weights (module docstring)."""
    sys.path.insert(0, str(ROOT))
    from vlmbatch.models.internvl.random import INTERNVL3_1B, save_random_internvl

    shape = {**INTERNVL3_1B, **{part: {**INTERNVL3_1B[part], **widths}  # type: ignore[dict-item]
                                for part, widths in NARROW_WIDTHS.items()}}
    return save_random_internvl(folder / "internvl3-1b-narrow", **shape)  # type: ignore[arg-type]


def report(shape: str, images: int, rows: list[tuple[str, dict]]) -> None:
    """One table per model: per question ops, calls and ms, and ops per layer; the ratio of
    this tree to the other and how far apart their answers are."""
    n = rows[0][1]["questions"]
    print(f"\n{shape}: {images} images, {n} questions")
    print(f"{'tree':<10}{'ops/q':>9}{'calls/q':>10}{'ms/q':>9}{'ops/dec layer':>15}"
          f"{'ops/vis layer':>15}")
    for name, r in rows:
        q = r["questions"]
        print(f"{name:<10}{r['ops'] / q:>9.1f}{r['calls'] / q:>10.1f}"
              f"{1000 * r['wall_s'] / q:>9.3f}{r['decoder_layer_ops']:>15.1f}"
              f"{r['vision_layer_ops']:>15.1f}")
    if len(rows) == 2:
        (_, a), (_, b) = rows
        print(f"{'after/before':<10}{a['ops'] / b['ops']:>9.2f}{a['calls'] / b['calls']:>10.2f}"
              f"{a['wall_s'] / b['wall_s']:>9.2f}"
              f"{a['decoder_layer_ops'] / b['decoder_layer_ops']:>15.2f}"
              f"{a['vision_layer_ops'] / b['vision_layer_ops']:>15.2f}")
        d = max(abs(x - y) for x, y in zip(a["p_yes"], b["p_yes"]))
        print(f"max |dP(yes)| after vs before: {d:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="another checkout to measure beside this one")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--images", type=int, default=32, help="first N easy-vqa test images")
    ap.add_argument("--warm", type=int, default=16, help="train images answered first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--question-rows", choices=["on", "auto", "off"], default="on",
                    help="EngineConfig.question_rows of the tree that has it (default on: "
                    "the path CUDA runs, whose ops are the launches counted; auto: this "
                    "device's default, the phases on a CPU)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    shapes = args.shapes.split(",")
    if bad := sorted(set(shapes) - set(SHAPES)):
        ap.error(f"unknown shapes {bad}")
    trees = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    print(f"load average {os.getloadavg()[0]:.2f} (wall times are load-sensitive; counts "
          f"are not); {args.threads} torch thread(s)")
    with tempfile.TemporaryDirectory(prefix="vlmbatch-host-") as tmp:
        for shape in shapes:
            model = None if shape == "builtin" else narrow_model(Path(tmp))
            rows = [(name, run_tree(tree, model, args)) for name, tree in trees]
            report(shape, args.images, rows)


if __name__ == "__main__":
    main()
