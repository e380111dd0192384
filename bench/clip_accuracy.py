"""The built-in InternVL's yes/no accuracy on multi-frame shape clips and image pairs.

Each case is a few shape scenes from the training's generator (``vlmbatch/cli/bench/shapes.py``,
``make_scene``; a seed the training never used) and one presence question ("Is there a red
shape?", "Is there a circle?", "Is there a red circle?") whose answer is *yes* iff some frame
(or image) has it. Half the cases are built to be *no* (every scene drawn without the
attribute, by rejection from the same generator); half *yes*, and of these half have the
attribute in exactly one frame (the needle), the rest in 1..F frames. Each case is also
asked ``--extra`` presence questions drawn at random, their truth read off the frames.

- clips: each scene held for 2 frames of a lossless FFV1 clip (all scenes one size per
  clip), sampled with ``num_frames`` = F by the checkpoint's plan (``VideoPlan.prepare``,
  the path ``vlmbatch run`` takes): InternVL's segment middles pick one frame of each scene,
  which the script checks, so the truth is over the frames the model saw;
- pairs: two scenes of their own sizes, each prepared as a still image, in one prompt
  (``MediaItem``, InternVL's multi-image prompt).

    python bench/clip_accuracy.py --cases 240            # clips of 4 and 8 frames, pairs

Prints accuracy per set and per kind of question, and exits 1 (after the table) if a set
is below ``--target``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.cli.bench.clip_scenes import HOLD, KINDS, Case, encode_clip, make_cases  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402

# scripts/train_default_model.py draws scenes from seed 0 and multi-frame cases from 1
HELD_OUT_SEED = 4_404


@dataclass
class Tally:
    right: int = 0
    total: int = 0

    def add(self, ok: bool) -> None:
        self.right += ok
        self.total += 1

    @property
    def accuracy(self) -> float:
        return self.right / max(self.total, 1)


def score(engine, cases: list[Case], items: list) -> dict[str, Tally]:  # noqa: ANN001
    """Ask every case's questions of its item; tallies: all, built, needle, yes, no, and
    per kind of question."""
    from vlmbatch.engine.records import Request

    requests, truths = [], []
    for i, case in enumerate(cases):
        for j, (attr, truth) in enumerate(case.questions):
            requests.append(Request(i, attr.text))
            truths.append((case, j, attr, truth))
    tallies = {k: Tally() for k in ("all", "built", "needle", "yes", "no", *KINDS)}
    for g in range(0, len(cases), 16):  # groups of 16 items, as a run's
        group = [(r, t) for r, t in zip(requests, truths) if g <= r.image < g + 16]
        rs = [Request(r.image - g, r.question) for r, _ in group]
        for (_, (case, j, attr, truth)), s in zip(group, engine.score(items[g: g + 16], rs)):
            ok = (s.p_yes >= 0.5) == truth
            tallies["all"].add(ok)
            tallies["yes" if truth else "no"].add(ok)
            tallies[attr.family].add(ok)
            if j == 0:
                tallies["built"].add(ok)
                if case.needle:
                    tallies["needle"].add(ok)
    return tallies


def clip_items(engine, cases: list[Case], frames: int) -> list:  # noqa: ANN001
    """Each case's clip through the checkpoint's video plan, ``num_frames`` = F; checks that
    one frame of each scene was sampled (so the cases' truth is over the frames seen)."""
    from vlmbatch.engine.records import MediaItem

    plan = engine.video_plan.with_sampling(num_frames=frames)
    items = []
    for case in cases:
        video = plan.prepare(encode_clip(case), 10**9)
        seen = [i // HOLD for i in video.frame_indices]
        if seen != list(range(frames)):
            raise SystemExit(f"sampling saw scenes {seen}, not each of {frames} once")
        items.append(MediaItem((video,)))
    return items


def pair_items(engine, cases: list[Case]) -> list:  # noqa: ANN001
    from vlmbatch.engine.records import MediaItem

    return [MediaItem(tuple(engine.image_plan.prepare(s.image) for s in case.scenes))
            for case in cases]


def evaluate(model: Path, n: int, frame_counts: tuple[int, ...] = (4, 8), pairs: bool = True,
             dtype: str = "float32", threads: int | None = None, extra: int = 3
             ) -> dict[str, dict[str, Tally]]:
    """{set name: tallies} for clips of each F in ``frame_counts`` and image pairs."""
    from vlmbatch.engine.build import build_engine
    from vlmbatch.engine.config import EngineConfig, ModelConfig

    engine = build_engine(ModelConfig(model, "cpu", dtype), EngineConfig(), threads)
    out = {}
    for f in frame_counts:
        cases = make_cases(n, f, True, HELD_OUT_SEED, extra)
        out[f"clips, {f} frames"] = score(engine, cases, clip_items(engine, cases, f))
    if pairs:
        cases = make_cases(n, 2, False, HELD_OUT_SEED, extra)
        out["image pairs"] = score(engine, cases, pair_items(engine, cases))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--cases", type=int, default=240, help="clips (and pairs) per set")
    ap.add_argument("--extra", type=int, default=3, help="random questions per case")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.98)
    args = ap.parse_args()
    start = time.perf_counter()
    result = evaluate(args.model, args.cases, dtype=args.dtype, threads=args.threads,
                      extra=args.extra)
    cols = ("all", "built", "needle", "yes", "no", *KINDS)
    print(f"{'set':<18}" + "".join(f"{c:>14}" for c in cols))
    low = []
    for name, t in result.items():
        print(f"{name:<18}" + "".join(f"{t[c].accuracy:>8.4f} {t[c].total:>5}" for c in cols))
        if t["all"].accuracy < args.target:
            low.append(name)
    print(f"({time.perf_counter() - start:.0f} s; accuracy, questions)")
    if low:
        print(f"below {args.target}: {', '.join(low)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
