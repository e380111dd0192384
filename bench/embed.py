"""Embedding throughput: vlmbatch vs the transformers loop a user would write, one process.

Two image sets, each image alone (an image-only input), and texts:

- ``easy-vqa``: the first ``--images`` easy-vqa test images (64 x 64 px: one tile either way);
- ``scenes``: ``--images`` shape scenes (``vlmbatch/cli/bench/shapes.py``, seed 0; 48-400 px, aspect
  ratios up to 1:4), written as PNG files: InternVL's reference tiling gives them 1-7 tiles,
  our default (reduced) tiling fewer (``docs/preprocessing.md``);
- texts: the 24 captions "a {colour} {shape}", repeated to ``--texts``.

Rows, each timed over ``--rounds`` interleaved rounds, best kept:

- vlmbatch: ``VLM(model).embed_many`` (read, OpenCV decode and tiling on the default
  preprocessing threads, the vision encoder once per image, prefill batched by token budget
  and cut after ``</img>``, pooling on the device), with its defaults;
- vlmbatch, ``vit_backend="onnxruntime"``: the vision encoder on onnxruntime;
- vlmbatch, ``tiling="reference"``: the model card's grid, as the transformers row; its
  vectors are compared with that row's (minimum cosine; OpenCV and Pillow resample a little
  differently, so not exactly 1);
- transformers: ``InternVLForConditionalGeneration`` on SDPA, ``--batch`` inputs per forward:
  Pillow tiles (the model card's path), the whole prompt right-padded with an attention mask,
  ``output_hidden_states=True``, the last hidden states averaged over each row's
  ``<img>``..``</img>`` span (a text: its tokens), L2 (``engine/pooling.py``'s rule).

Printed: embeddings/s per row and set, each row's ratio to transformers, the agreement, and
the process's peak RSS after each row's set-up. The agreement is checked: a minimum cosine
under ``--check-cos`` (0.999; what it measured: ``docs/embeddings.md``) exits 1 after
the tables, naming the set on stderr. Same torch threads for all (``--threads``).
Not a test: timings on shared machines are noisy, so compare rows of one run.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import easy_vqa
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checks import Checks  # noqa: E402
from vlmbatch import VLM  # noqa: E402
from vlmbatch.cli.bench.shapes import make_scene  # noqa: E402
from vlmbatch.cli.embed_eval import COLOURS, SHAPES, caption  # noqa: E402
from vlmbatch.engine.pooling import pool_range  # noqa: E402
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL  # noqa: E402
from vlmbatch.preprocessing.reference import pillow_tiles, pixel_values  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Transformers:
    """The user's loop: batched forwards, hidden states pooled by hand."""

    def __init__(self, model_dir: Path, vlm: VLM, batch: int) -> None:
        from transformers import InternVLForConditionalGeneration

        self.ref = InternVLForConditionalGeneration.from_pretrained(
            str(model_dir), attn_implementation="sdpa").eval()
        self.spec, self.prompts, self.batch = vlm.engine.model.spec, vlm.engine.model.prompts, batch
        self.pad = vlm.engine.model.tokenizer.pad_token_id
        self.image_prompt = vlm.engine.model.family.image_prompt

    def images(self, paths: list[str]) -> np.ndarray:
        t = self.spec.tiling
        out = []
        for i in range(0, len(paths), self.batch):
            tiles = [pillow_tiles(Path(p).read_bytes(), t.tile_size, t.min_tiles, t.max_tiles)
                     for p in paths[i: i + self.batch]]
            prompts = [self.prompts.build_for_tiles(self.image_prompt, len(x)) for x in tiles]
            pv = pixel_values([x for ts in tiles for x in ts], self.spec.vision.mean,
                              self.spec.vision.std)
            out.append(self._pool(prompts, pv))
        return np.concatenate(out)

    def texts(self, texts: list[str]) -> np.ndarray:
        out = []
        for i in range(0, len(texts), self.batch):
            prompts = [self.prompts.embed(t, None) for t in texts[i: i + self.batch]]
            out.append(self._pool(prompts, None))
        return np.concatenate(out)

    def _pool(self, prompts: list, pv: torch.Tensor | None) -> np.ndarray:
        """One forward over the whole prompts (the image prompt's text included, as a user
        following jina's template runs it), pooled."""
        ids = [list(p.ids) for p in prompts]
        t = max(map(len, ids))
        x = torch.tensor([r + [self.pad] * (t - len(r)) for r in ids])
        mask = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in ids])
        with torch.inference_mode():
            kw = {} if pv is None else {"pixel_values": pv}
            h = self.ref(input_ids=x, attention_mask=mask, output_hidden_states=True,
                         **kw).hidden_states[-1]
        vecs = []
        for j, p in enumerate(prompts):
            g = pool_range(p, "image-mean")
            vecs.append(F.normalize(h[j, g.start: g.end].mean(0), dim=0))
        return torch.stack(vecs).numpy()


def scene_files(n: int, folder: Path) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p = folder / f"scene_{i}.png"
        cv2.imwrite(str(p), cv2.cvtColor(make_scene(rng).image, cv2.COLOR_RGB2BGR))
        out.append(str(p))
    return out


def ours(vlm: VLM, inputs: list) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        if vlm.engine.cache is not None:
            vlm.engine.cache.clear()  # no round reuses another's prefixes
        return np.stack([e.vector for e in vlm.embed_many(inputs)])
    return run


def interleaved(rows: dict[str, Callable[[], np.ndarray]], rounds: int
                ) -> dict[str, tuple[float, np.ndarray]]:
    """Best seconds and the output of each row, rounds interleaved (order rotated)."""
    best = {name: (float("inf"), np.zeros(0)) for name in rows}
    names = list(rows)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            out = rows[name]()
            best[name] = (min(best[name][0], time.perf_counter() - start), out)
    return best


def report(title: str, n: int, res: dict[str, tuple[float, np.ndarray]], checks: Checks,
           min_cos: float) -> None:
    base = res["transformers"][0]
    print(f"{title} ({n}):")
    for name, (secs, _) in res.items():
        print(f"  {name:<32} {n / secs:>8.1f}/s  {base / secs:>5.2f}x")
    if "vlmbatch, reference tiling" in res:
        v, w = res["vlmbatch, reference tiling"][1], res["transformers"][1]
        cos = float((v * w).sum(1).min())
        ok = checks.verdict(cos >= min_cos, f"{title}: reference tiling vs transformers, min "
                            f"cosine {cos:.5f} >= {min_cos:g}")
        print(f"  agreement, reference tiling vs transformers: min cosine {cos:.5f} {ok}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_EMBED_MODEL)
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--texts", type=int, default=240)
    ap.add_argument("--batch", type=int, default=32, help="transformers inputs per forward")
    ap.add_argument("--per-batch", type=int, default=None,
                    help="vlmbatch inputs per embedder call (default: the API's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check-cos", type=float, default=0.999,
                    help="least min cosine, reference tiling vs transformers; exit 1 below it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checks = Checks()
    tmp = Path(tempfile.mkdtemp(prefix="vlmbatch-bench-embed-"))
    sets = {"easy-vqa": [easy_vqa.get_test_image_paths()[i] for i in range(args.images)],
            "scenes": scene_files(args.images, tmp)}
    texts = ([caption(c, s) for c in COLOURS for s in SHAPES] * args.texts)[: args.texts]
    kw = {"images_per_batch": args.per_batch} if args.per_batch else {}
    vlms = {"vlmbatch": VLM(args.model, **kw),
            "vlmbatch, onnxruntime ViT": VLM(args.model, vit_backend="onnxruntime", **kw),
            "vlmbatch, reference tiling": VLM(args.model, tiling="reference", **kw)}
    rss = {"vlmbatch rows": peak_rss_mib()}
    hf = Transformers(args.model, vlms["vlmbatch"], args.batch)
    rss["transformers"] = peak_rss_mib()
    for title, paths in sets.items():
        rows = {name: ours(v, [(Path(p), None) for p in paths]) for name, v in vlms.items()}
        rows["transformers"] = lambda paths=paths: hf.images(paths)  # type: ignore[misc]
        for fn in rows.values():
            fn()  # warm-up (the onnxruntime export, allocator, kernel choice)
        report(f"images, {title}", len(paths), interleaved(rows, args.rounds), checks,
               args.check_cos)
    text_rows = {"vlmbatch": ours(vlms["vlmbatch"], texts),
                 "transformers": lambda: hf.texts(texts)}
    for fn in text_rows.values():
        fn()
    report("texts", len(texts), interleaved(text_rows, args.rounds), checks, args.check_cos)
    print(f"{args.model.name}, {args.threads} torch threads, best of {args.rounds} "
          f"interleaved rounds; peak RSS MiB after set-up: vlmbatch rows "
          f"{rss['vlmbatch rows']:.0f}, + transformers {rss['transformers']:.0f}, end "
          f"{peak_rss_mib():.0f}")
    shutil.rmtree(tmp, ignore_errors=True)
    checks.exit()


if __name__ == "__main__":
    main()
