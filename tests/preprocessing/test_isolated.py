"""Decoder processes (``preprocessing/isolated.py``): the same tiles as in this process, in
order, two items in a worker's pipe at once; a hang or a crash fails that item only and the
items behind it go to a fresh worker; errors keep their type; stopping kills at once and
leaves no process behind."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests import fault_points as fp
from tests.waiting import wait_until
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecoderPool, DecodeTimeout
from vlmbatch.preprocessing.prepare import TilingConfig, prepare_bytes
from vlmbatch.preprocessing.sources import SourceError

PLAN = TilingConfig(tile_size=56, max_tiles=6)


def images(folder: Path, n: int) -> list[Path]:
    rng = np.random.default_rng(n)
    out = []
    for i in range(n):
        h, w = (int(x) for x in rng.integers(20, 200, 2))
        cv2.imwrite(str(folder / f"{i}.png"), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        out.append(folder / f"{i}.png")
    return out


def children() -> set[int]:
    """Pids of this process's decoder processes still alive."""
    out = set()
    for d in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"vlmbatch.preprocessing.decoder_process" in cmd:
            out.add(int(d))
    return out


@pytest.mark.parametrize("slot_bytes", [64 << 20, 4096])  # shared memory; pickled
def test_tiles_equal_this_process_s(tmp_path: Path, slot_bytes: int) -> None:
    paths = images(tmp_path, 12)
    pool = DecoderPool(2, PLAN, 10**8, 30.0, slot_bytes=slot_bytes)
    try:
        got = [f.result() for f in [pool.submit(str(p), tmp_path) for p in paths]]
        got.append(pool.submit(paths[0].read_bytes(), tmp_path).result())  # bytes in
    finally:
        pool.stop()
    for p, g in zip([*paths, paths[0]], got, strict=True):
        want = prepare_bytes(p.read_bytes(), PLAN, 10**8)
        assert g.content_hash == want.content_hash and g.grid == want.grid
        assert (g.width, g.height) == (want.width, want.height)
        np.testing.assert_array_equal(g.tiles, want.tiles)
        assert g.tiles.flags.writeable and g.tiles.flags.c_contiguous


def test_errors_keep_their_types(tmp_path: Path) -> None:
    (tmp_path / "text.png").write_text("hello")
    from PIL import Image

    Image.new("1", (12_000, 10_000)).save(tmp_path / "huge.png")
    pool = DecoderPool(1, PLAN, 10**8, 30.0)
    try:
        cases = {"nope.png": SourceError, "text.png": ImageError, "huge.png": ImageTooLarge,
                 "http://x/a.png": SourceError}
        for name, kind in cases.items():
            with pytest.raises(kind) as e:
                pool.submit(name, tmp_path).result()
            assert type(e.value) is kind
    finally:
        pool.stop()


@pytest.mark.parametrize("fault", ["hang", "segfault", "exit"])
def test_a_hang_or_a_crash_fails_that_item_and_the_next_goes_on(tmp_path: Path,
                                                                fault: str) -> None:
    paths = images(tmp_path, 5)
    before = {"hang": functools.partial(fp.hang_on, "2.png"),
              "segfault": functools.partial(fp.segfault_on, "2.png"),
              "exit": functools.partial(fp.crash_on, "2.png")}[fault]
    pool = DecoderPool(1, PLAN, 10**8, 2.0, before=before)  # one worker: it must be replaced
    t0 = time.monotonic()
    try:
        futures = [pool.submit(str(p), tmp_path) for p in paths]
        for i, f in enumerate(futures):
            if i != 2:
                assert f.result(timeout=60).tiles.shape[1:] == (56, 56, 3)
                continue
            kind = DecodeTimeout if fault == "hang" else DecoderCrashed
            with pytest.raises(kind) as e:
                f.result(timeout=60)
            says = {"hang": "decoding timed out after 2s (worker killed)",
                    "segfault": "preprocessing worker died (killed by SIGSEGV)",
                    "exit": "preprocessing worker died (exit code 11)"}[fault]
            assert str(e.value) == says
    finally:
        pool.stop()
    assert time.monotonic() - t0 < 40


def test_stop_kills_a_busy_worker_at_once(tmp_path: Path) -> None:
    (p,) = images(tmp_path, 1)
    pool = DecoderPool(2, PLAN, 10**8, 600.0, before=functools.partial(fp.hang_on, ".png"))
    for _ in range(6):  # each worker takes up to two at a time
        pool.submit(str(p), tmp_path)
    wait_until(lambda: len(children()) >= 2, 60, "two decoder processes")
    assert len(children()) == 2
    t0 = time.monotonic()
    pool.stop()
    wait_until(lambda: not children(), 10, "no decoder process left after stop()")
    assert time.monotonic() - t0 < 10


def test_start_starts_the_workers_before_any_item(tmp_path: Path) -> None:
    """``start`` (the fetch stage's, while the first bytes travel): both workers come up with
    no item submitted; items then go to them as usual; stop leaves none."""
    paths = images(tmp_path, 4)
    pool = DecoderPool(2, PLAN, 10**8, 30.0)
    try:
        assert not pool.live
        pool.start()
        wait_until(lambda: len(pool.live) == 2, 60, "two decoder processes started")
        started = set(pool.live)
        got = [f.result() for f in [pool.submit(str(p), tmp_path) for p in paths]]
        assert set(pool.live) == started  # the same two, none more
    finally:
        pool.stop()
    for p, g in zip(paths, got, strict=True):
        np.testing.assert_array_equal(g.tiles, prepare_bytes(p.read_bytes(), PLAN, 10**8).tiles)
    wait_until(lambda: not children(), 10, "no decoder process left")
