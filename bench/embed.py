"""Embedding throughput: vlmbatch vs the transformers loop a user would write, one process.

Rows (images, then texts), each timed over ``--rounds`` interleaved rounds, best kept:

- vlmbatch: ``VLM(model).embed_many`` over the image files (read, OpenCV decode and tiling,
  the vision encoder once per image, batched prefill cut after ``</img>``, pooling on the
  device) and over the texts; ``--tiling reference`` so both rows see the model card's
  grid;
- transformers: ``InternVLForConditionalGeneration`` on SDPA, ``--batch`` inputs per forward:
  Pillow tiles (the model card's path), the same prompt ids right-padded with an attention
  mask, ``output_hidden_states=True``, the last hidden states averaged over each row's
  ``<img>``..``</img>`` span (a text: its tokens), L2 (``pipeline/pooling.py``'s rule).

Printed: embeddings/s per row, the ratio, the two rows' agreement (minimum cosine between
their vectors: tiles differ by OpenCV vs Pillow resampling, so not exactly 1) and the
process's peak RSS after each row's set-up. Same torch threads for all (``--threads``).
Images: the first ``--images`` easy-vqa test images; texts: the 24 captions "a {colour}
{shape}", repeated to ``--texts``. Not a test: timings on shared machines are noisy.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import easy_vqa
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import DEFAULT_EMBED_MODEL  # noqa: E402
from pipeline.embed_eval import COLOURS, SHAPES, caption  # noqa: E402
from pipeline.pooling import pool_range  # noqa: E402
from preprocessing.reference import pillow_tiles, pixel_values  # noqa: E402
from vlmbatch import VLM  # noqa: E402


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


def timed(fn, rounds: int) -> tuple[float, np.ndarray]:  # noqa: ANN001
    best, out = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_EMBED_MODEL)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--texts", type=int, default=480)
    ap.add_argument("--batch", type=int, default=32, help="transformers inputs per forward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    paths = [easy_vqa.get_test_image_paths()[i] for i in range(args.images)]
    texts = ([caption(c, s) for c in COLOURS for s in SHAPES] * args.texts)[: args.texts]
    vlm = VLM(args.model, tiling="reference", images_per_batch=64, preprocess_threads=0)
    ours_images = lambda: np.stack([e.vector for e in vlm.embed_many(  # noqa: E731
        [(Path(p), None) for p in paths])])
    ours_texts = lambda: np.stack([e.vector for e in vlm.embed_many(texts)])  # noqa: E731
    ours_images(), ours_texts()  # warm-up
    rss_ours = peak_rss_mib()
    hf = Transformers(args.model, vlm, args.batch)
    hf.images(paths[: args.batch]), hf.texts(texts[: args.batch])
    rss_hf = peak_rss_mib()
    rows = {}
    for name, ours, theirs, n in (("images", ours_images, lambda: hf.images(paths), len(paths)),
                                  ("texts", ours_texts, lambda: hf.texts(texts), len(texts))):
        t_ours, v_ours = timed(ours, args.rounds)
        t_hf, v_hf = timed(theirs, args.rounds)
        cos = float((v_ours * v_hf).sum(1).min())
        rows[name] = (n / t_ours, n / t_hf, cos)
    print(f"{args.model.name}, {args.images} images ({len(set(paths))} files), "
          f"{args.texts} texts, {args.threads} threads, best of {args.rounds}")
    print(f"{'row':<7} {'vlmbatch/s':>11} {'transformers/s':>15} {'ratio':>6} {'min cos':>8}")
    for name, (ours_rate, hf_rate, cos) in rows.items():
        print(f"{name:<7} {ours_rate:>11.1f} {hf_rate:>15.1f} {ours_rate / hf_rate:>5.2f}x "
              f"{cos:>8.5f}")
    print(f"peak RSS MiB: after vlmbatch set-up {rss_ours:.0f}, after transformers set-up "
          f"{rss_hf:.0f}, at the end {peak_rss_mib():.0f}")


if __name__ == "__main__":
    main()
