"""The retrieval evaluation (``cli/embed_eval.py``): labels read off easy-vqa's
questions, the two figures on vectors whose answer is known, and ``vlmbatch embed --eval``."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.embed_eval import COLOURS, SHAPES, labels, retrieval
from vlmbatch.cli.main import main


def test_labels_cover_every_caption() -> None:
    test = labels("test")
    assert len(test) == 880  # of 1,000: the images whose questions settle both
    per = Counter(test.values())
    assert set(per) == {(c, s) for c in COLOURS for s in SHAPES} and min(per.values()) >= 10
    assert len(labels("train")) == 3542


def test_figures_on_known_vectors() -> None:
    """One-hot class vectors: every figure is 1; the same vectors under shuffled labels
    score about chance."""
    rng = np.random.default_rng(0)
    caps = [(c, s) for c in COLOURS for s in SHAPES]
    lab = [caps[int(k)] for k in rng.permutation(np.arange(300) % 24)]  # 12-13 per caption
    onehot = np.eye(24, dtype=np.float32)
    images = onehot[[caps.index(x) for x in lab]] + 0.01 * rng.standard_normal((300, 24))
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    good = retrieval(images.astype(np.float32), lab, onehot, caps)
    assert min(good.precision_at_10.values()) == 1.0 and good.image_top1 == 1.0
    shuffled = [lab[i] for i in rng.permutation(300)]
    bad = retrieval(images.astype(np.float32), shuffled, onehot, caps)
    assert np.mean(list(bad.precision_at_10.values())) < 0.3 and bad.image_top1 < 0.3


def test_cli_eval_gives_the_figures_the_docs_state(capsys) -> None:  # noqa: ANN001
    """``vlmbatch embed --eval`` with the built-in embedding model on the whole labelled test
    gallery (880 images; ~15 s on 2 cores): text -> image precision@10 1.000 for every one of
    the 24 captions, and image -> image top-1 0.9943 (875 of 880: docs/figures.md, docs/models.md).
    The bounds allow one image less (>= 874), not a caption less."""
    assert main(["embed", "--eval"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "easy-vqa test, 880 labelled images" in out and "a brown triangle" in out
    per_caption = re.findall(r"^  a \w+ \w+ +(\d\.\d+)$", out, re.M)
    assert len(per_caption) == 24 and {float(p) for p in per_caption} == {1.0}, out
    assert re.search(r"^  min 1\.000, mean 1\.000$", out, re.M), out
    (top1,) = re.findall(r"image -> image top-1 same colour and shape: (\d\.\d+)", out)
    assert float(top1) >= 874 / 880, out
