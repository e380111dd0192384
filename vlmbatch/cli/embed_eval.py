"""Retrieval quality on easy-vqa's *test* images: ``vlmbatch embed --eval``.

Each test image shows one shape of one colour. Labels come from the image's own questions
(``labels``: the answer to "what color/shape ..." or a yes/no question that settles it); the
images whose questions settle both colour and shape (880 of the 1,000 test images) are the
gallery, the others cannot be judged and are left out. Two figures:

- text -> image: for each of the 24 captions "a {colour} {shape}", the share of the 10
  nearest gallery images (cosine) that show that colour and shape (precision@10);
- image -> image: the share of gallery images whose nearest other gallery image has the same
  colour and shape (top-1).

Images are embedded as ``vlmbatch embed`` embeds them (read, decode, tile, the embedder); the
built-in embedding model never saw this split (its training reads easy-vqa's train split).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import easy_vqa
import numpy as np

from vlmbatch.engine.embed import EmbedHandle
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.records import EmbedItem
from vlmbatch.pipeline.task import EmbedTask

COLOURS = ("red", "green", "blue", "black", "gray", "teal", "yellow", "brown")
SHAPES = ("circle", "rectangle", "triangle")
_COLOUR = re.compile(r"\b(" + "|".join(COLOURS) + r")\b")
_SHAPE = re.compile(r"\b(" + "|".join(SHAPES) + r")\b")
_NEGATED = re.compile(r"\b(not|no)\b")


def caption(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def labels(split: str = "test") -> dict[int, tuple[str, str]]:
    """image id -> (colour, shape), for the images whose questions settle both: an open
    answer names it ("what color is the shape?" -> "red"; "what is the red shape?" names the
    colour in the question), a yes/no answer settles what a question asserts present."""
    qs, answers, ids = (easy_vqa.get_test_questions() if split == "test"
                        else easy_vqa.get_train_questions())
    found: dict[int, dict[str, str]] = {}
    for q, a, i in zip(qs, answers, ids):
        got = found.setdefault(i, {})
        c, s = _COLOUR.search(q), _SHAPE.search(q)
        if a in ("yes", "no"):
            if (a == "yes") != bool(_NEGATED.search(q)):  # the attribute asked is present
                if c:
                    got["colour"] = c.group()
                elif s:
                    got["shape"] = s.group()
            continue
        got["shape" if a in SHAPES else "colour"] = a
        if c:
            got["colour"] = c.group()
        if s:
            got["shape"] = s.group()
    return {i: (d["colour"], d["shape"]) for i, d in sorted(found.items()) if len(d) == 2}


@dataclass(frozen=True)
class RetrievalResult:
    precision_at_10: dict[str, float]  # caption -> text -> image precision@10
    image_top1: float  # image -> image: nearest other image of the same colour and shape
    images: int  # the gallery's size

    def text(self) -> str:
        p = self.precision_at_10
        rows = [f"  {c:<18} {v:.3f}" for c, v in p.items()]
        return "\n".join([f"easy-vqa test, {self.images} labelled images", "text -> image "
                          "precision@10 per caption:", *rows,
                          f"  min {min(p.values()):.3f}, mean {np.mean(list(p.values())):.3f}",
                          f"image -> image top-1 same colour and shape: {self.image_top1:.4f}"])


def embed_texts(embedder: EmbedHandle, texts: list[str]) -> np.ndarray:
    """[N, D] unit vectors of texts alone."""
    return np.stack([v.values for v in embedder.embed([], [EmbedRequest(None, t)
                                                          for t in texts])])


def embed_images(embedder: EmbedHandle, paths: list[str], images_per_batch: int = 64,
                 opts: PrepareOptions = PrepareOptions()) -> np.ndarray:
    """[N, D] unit vectors of image files, through the same drive loop as the CLI."""
    items = [EmbedItem(k, str(k), p, None, Path(p).parent) for k, p in enumerate(paths)]
    out = []
    for _, results in drive(EmbedTask(embedder.cfg), embedder.engine,
                            groups_of(items, images_per_batch), opts):
        for (e,) in results:
            if e.vector is None:
                raise RuntimeError(f"{paths[e.index]}: {e.error}")
            out.append(e.vector)
    return np.stack(out)


def retrieval(image_vecs: np.ndarray, image_labels: list[tuple[str, str]],
              caption_vecs: np.ndarray, captions: list[tuple[str, str]]) -> RetrievalResult:
    """The two figures from unit vectors: ``image_vecs [N, D]`` labelled ``image_labels``,
    ``caption_vecs [C, D]`` for the (colour, shape) ``captions``."""
    lab = np.array([COLOURS.index(c) * len(SHAPES) + SHAPES.index(s) for c, s in image_labels])
    sims = caption_vecs @ image_vecs.T  # [C, N]
    p10 = {}
    for (c, s), row in zip(captions, sims):
        top = np.argsort(-row, kind="stable")[:10]
        p10[caption(c, s)] = float(np.mean(lab[top] == COLOURS.index(c) * len(SHAPES)
                                           + SHAPES.index(s)))
    ii = image_vecs @ image_vecs.T
    np.fill_diagonal(ii, -np.inf)
    top1 = float(np.mean(lab[ii.argmax(1)] == lab))
    return RetrievalResult(p10, top1, len(lab))


def evaluate_retrieval(embedder: EmbedHandle, split: str = "test", limit: int | None = None,
                       opts: PrepareOptions = PrepareOptions()) -> RetrievalResult:
    """Both figures for ``embedder`` on easy-vqa's labelled ``split`` images (first
    ``limit``)."""
    lab = labels(split)
    paths = easy_vqa.get_test_image_paths() if split == "test" else \
        easy_vqa.get_train_image_paths()
    ids = list(lab)[:limit]
    image_vecs = embed_images(embedder, [paths[i] for i in ids], opts=opts)
    captions = [(c, s) for c in COLOURS for s in SHAPES]
    caption_vecs = embed_texts(embedder, [caption(c, s) for c, s in captions])
    return retrieval(image_vecs, [lab[i] for i in ids], caption_vecs, captions)
