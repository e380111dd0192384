"""The in-process runner's prefetching: groups prepared by a thread pool, ahead of the model,
equal to groups prepared one by one in the main thread."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from jobs.manifest import ImageItem, Question
from jobs.runner import PreparedGroup, prepare_group, prepared_groups
from pipeline.cli import main
from preprocessing.prepare import TilingConfig

TILING = TilingConfig(tile_size=56)


def items(folder: Path, n: int, seed: int) -> list[ImageItem]:
    """n random images of random sizes; every fifth one a missing file (its error)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        name = f"{seed}_{i}.png"
        if i % 5 != 4:
            h, w = (int(x) for x in rng.integers(20, 300, 2))
            cv2.imwrite(str(folder / name), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        out.append(ImageItem(f"i{i}", name, (Question("q", "Red?"),), folder))
    return out


def groups_of(xs: list, n: int) -> list[list]:
    return [xs[i: i + n] for i in range(0, len(xs), n)]


def assert_same(a: PreparedGroup, b: PreparedGroup) -> None:
    assert a.group == b.group and a.errors == b.errors
    for x, y in zip(a.images, b.images, strict=True):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.content_hash == y.content_hash and x.grid == y.grid
            np.testing.assert_array_equal(x.tiles, y.tiles)


@pytest.mark.parametrize("threads", [1, 3])
def test_prefetched_groups_equal_serial_ones_in_order(tmp_path: Path, threads: int) -> None:
    its = items(tmp_path, 23, seed=threads)
    serial = [prepare_group(g, TILING, 10**8) for g in groups_of(its, 4)]
    got = list(prepared_groups(groups_of(its, 4), TILING, 10**8, threads))
    assert len(got) == len(serial) == 6
    for a, b in zip(got, serial, strict=True):
        assert_same(a, b)
    assert sum(len(g.errors) for g in got) == 4  # the missing files, as errors


def test_stopping_early_reads_only_a_few_groups_ahead(tmp_path: Path) -> None:
    its = items(tmp_path, 40, seed=7)
    pulled = []

    def source():  # noqa: ANN202
        for g in groups_of(its, 2):
            pulled.append(g)
            yield g

    gen = prepared_groups(source(), TILING, 10**8, threads=2, ahead=2)
    first = next(gen)
    gen.close()  # cancels what has not started, waits for what has
    assert first.group == its[:2]
    assert len(pulled) == 3  # the current group and 2 ahead, not all 20


def test_an_unexpected_error_reaches_the_caller(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import jobs.runner

    def boom(*_: object) -> None:
        raise RuntimeError("a bug, not a bad image")

    monkeypatch.setattr(jobs.runner, "prepare_item", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        list(prepared_groups(groups_of(items(tmp_path, 4, seed=1), 2), TILING, 10**8, 2))


def test_run_with_and_without_preprocess_threads(tmp_path: Path,
                                                 random_model_dir: Path) -> None:
    its = items(tmp_path, 11, seed=3)
    (tmp_path / "m.jsonl").write_text("".join(
        json.dumps({"id": it.id, "image": it.image, "questions": ["Red?", "A circle?"]}) + "\n"
        for it in its))
    outs = []
    for threads in ("0", "3"):
        out = tmp_path / f"r{threads}.jsonl"
        assert main(["run", str(tmp_path / "m.jsonl"), "--model", str(random_model_dir),
                     "--images-per-batch", "3", "--preprocess-threads", threads, "-o", str(out),
                     "--no-progress"]) == 3  # the missing files
        outs.append(out.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 22
