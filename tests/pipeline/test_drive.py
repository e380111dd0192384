"""The drive loop (``pipeline/drive.py``): stage 1 prefetching (groups prepared by a thread
pool ahead of the model equal groups prepared one by one in the main thread), and the loop's
own rules (cancel before each group, a sink written a whole group at a time, an engine
failure failing that group only, how it ended)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

import vlmbatch.pipeline.preparers
from vlmbatch.cli.main import main
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import prepare_group, prepared_groups
from vlmbatch.pipeline.preparers import prepare_item
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.pipeline.task import AnswerTask, ImageRef, Prepared
from vlmbatch.preprocessing.prepare import PreparedImage, TilingConfig

TILING = TilingConfig(tile_size=56)
TASK = AnswerTask()


def opts(threads: int, ahead: int = 2) -> PrepareOptions:
    return PrepareOptions(10**8, threads, ahead=ahead)


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


def assert_same(a: Prepared, b: Prepared) -> None:
    assert a.items == b.items and a.errors == b.errors
    for x, y in zip(a.images, b.images, strict=True):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.content_hash == y.content_hash and x.grid == y.grid
            np.testing.assert_array_equal(x.tiles, y.tiles)


@pytest.mark.parametrize("threads", [1, 3])
def test_prefetched_groups_equal_serial_ones_in_order(tmp_path: Path, threads: int) -> None:
    its = items(tmp_path, 23, seed=threads)
    serial = [prepare_group(TASK, g, TILING, 10**8) for g in groups_of(its, 4)]
    got = list(prepared_groups(TASK, groups_of(its, 4), TILING, opts(threads)))
    assert len(got) == len(serial) == 6
    for a, b in zip(got, serial, strict=True):
        assert_same(a, b)
    assert sum(len(g.errors) for g in got) == 4  # the missing files, as errors


def slow_prepare(calls: list, gate: threading.Event | None = None):  # noqa: ANN201
    def prepare(ref: ImageRef, *_: object) -> PreparedImage:
        calls.append(ref.source)
        if gate is not None and ref.source.endswith("_2.png"):
            gate.wait()  # as a read on a hung mount would
        time.sleep(0.1)
        return prepare_item(ref, TILING)
    return prepare


def test_closing_cancels_what_has_not_started(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    calls: list[str] = []
    monkeypatch.setattr(vlmbatch.pipeline.preparers, "prepare_item", slow_prepare(calls))
    its = items(tmp_path, 12, seed=5)
    gen = prepared_groups(TASK, groups_of(its, 2), TILING, opts(1, ahead=2))
    next(gen)
    gen.close()
    time.sleep(1.0)  # what was queued would have run by now
    assert len(calls) <= 3, calls  # the first group, and at most the one then running


def test_a_stuck_preparation_does_not_hold_up_closing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    gate = threading.Event()
    monkeypatch.setattr(vlmbatch.pipeline.preparers, "prepare_item", slow_prepare([], gate))
    gen = prepared_groups(TASK, groups_of(items(tmp_path, 6, seed=6), 2), TILING, opts(1))
    next(gen)  # i0, i1; i2 then blocks its thread
    closer = threading.Thread(target=gen.close, daemon=True)
    closer.start()
    closer.join(5)
    alive = closer.is_alive()
    gate.set()
    assert not alive, "closing waited for a stuck read (Ctrl-C would hang)"


def test_a_pipe_is_refused_not_read(tmp_path: Path) -> None:
    from vlmbatch.preprocessing.sources import SourceError, read_bytes

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    result: list = []

    def read() -> None:
        try:
            read_bytes(str(fifo), tmp_path)
        except SourceError as e:
            result.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive() and "not a regular file" in result[0]


def test_stopping_early_reads_only_a_few_groups_ahead(tmp_path: Path) -> None:
    its = items(tmp_path, 40, seed=7)
    pulled = []

    def source():  # noqa: ANN202
        for g in groups_of(its, 2):
            pulled.append(g)
            yield g

    gen = prepared_groups(TASK, source(), TILING, opts(2, ahead=2))
    first = next(gen)
    gen.close()  # cancels what has not started, waits for what has
    assert first.items == its[:2]
    assert len(pulled) == 3  # the current group and 2 ahead, not all 20


def test_an_unexpected_error_reaches_the_caller(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    def boom(*_: object) -> None:
        raise RuntimeError("a bug, not a bad image")

    monkeypatch.setattr(vlmbatch.pipeline.preparers, "prepare_item", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        list(prepared_groups(TASK, groups_of(items(tmp_path, 4, seed=1), 2), TILING, opts(2)))


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


class _Listed:
    """Stages that hand out each group with one result per item (the item itself), and
    record what was asked of them."""

    def __init__(self) -> None:
        self.asked: list[list] = []
        self.closed = False

    def results(self, groups):  # noqa: ANN001, ANN201
        try:
            for g in groups:
                self.asked.append(g)
                yield g, [[x] for x in g]
        finally:
            self.closed = True


class _Sink:
    def __init__(self) -> None:
        self.got: list = []

    def write(self, items: list, results: list[list]) -> None:
        self.got.append((list(items), results))


def test_the_loop_writes_whole_groups_and_ends_done() -> None:
    from vlmbatch.pipeline.drive import Drive

    stages, sink = _Listed(), _Sink()
    d = Drive(stages, [[1, 2], [3]], sink)
    assert [items for items, _ in d] == [[1, 2], [3]]
    assert sink.got == [([1, 2], [[1], [2]]), ([3], [[3]])]
    assert d.final == "done" and stages.closed


def test_cancel_is_checked_before_each_group_including_the_first() -> None:
    from vlmbatch.pipeline.drive import Drive

    for after in (0, 1):
        stages, sink = _Listed(), _Sink()
        seen = []
        d = Drive(stages, [[1], [2], [3]], sink, cancelled=lambda: len(seen) >= after)
        for items, _ in d:
            seen.append(items)
        # no model work for a group once cancel is seen: not even the first
        assert len(stages.asked) == after and len(sink.got) == after
        assert d.final == "cancelled"
        assert stages.closed == (after > 0)  # never started: nothing to stop


def test_an_exception_or_an_early_stop_ends_interrupted() -> None:
    from vlmbatch.pipeline.drive import Drive

    class Failing(_Sink):
        def write(self, items: list, results: list[list]) -> None:
            raise OSError("disk full")

    stages = _Listed()
    d = Drive(stages, [[1], [2]], Failing())
    with pytest.raises(OSError, match="disk full"):
        list(d)
    assert d.final == "interrupted" and stages.closed
    stages = _Listed()
    d = Drive(stages, [[1], [2], [3]])
    it = iter(d)
    next(it)
    it.close()  # a consumer that stops early
    assert d.final == "interrupted" and stages.closed and len(stages.asked) == 1


def test_an_engine_failure_fails_that_group_keeping_earlier_errors(tmp_path: Path) -> None:
    from vlmbatch.pipeline.drive import run_group
    from vlmbatch.pipeline.records import ErrorKind

    class Broken:
        image_plan = TILING

        def score(self, images, requests):  # noqa: ANN001, ANN201
            raise MemoryError("out of memory")

    its = items(tmp_path, 5, seed=9)  # the fifth is a missing file
    p = prepare_group(TASK, its, TILING, 10**8)
    out = run_group(TASK, Broken(), p)  # type: ignore[arg-type]
    kinds = [r[0].error_kind for r in out]
    assert kinds == [ErrorKind.ENGINE] * 4 + [ErrorKind.SOURCE]
    assert "out of memory" in (out[0][0].error or "")
