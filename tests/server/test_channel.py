"""The engine channel's arena (``channel.Arena``): a prepared image put by one side reads
back in place, equal to the original, on a second mapping of the same memfd (as the engine
process maps it); freed regions merge, so the whole arena can be taken again; an image
that does not fit travels whole (pickled) instead."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.server.fakes import picture
from vlmbatch.preprocessing.prepare import TilingConfig
from vlmbatch.serving.channel import Arena, Residents

PLAN = TilingConfig(tile_size=16, max_tiles=4, use_thumbnail=True)


def arrays(image: object) -> dict[str, np.ndarray]:
    return {f.name: v for f in dataclasses.fields(image)  # type: ignore[arg-type]
            if isinstance(v := getattr(image, f.name), np.ndarray)}


@pytest.fixture
def arena():  # noqa: ANN201
    a = Arena(1 << 16)
    yield a
    a.close()


def test_an_image_reads_back_equal_on_another_mapping(arena: Arena) -> None:
    engine_side = Arena(arena.size, fd=arena.fd)  # the engine process's mapping
    images = [PLAN.prepare(picture(seed)) for seed in range(3)]
    packed = [arena.put(im) for im in images]
    assert all(p.layout is not None for p in packed)
    for im, p in zip(images, packed):
        got = engine_side.view(p)
        want = arrays(im)
        assert want and arrays(got).keys() == want.keys()
        for name, a in want.items():
            b = arrays(got)[name]
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
            assert b.ctypes.data % 64 == 0  # each array on a cache line
        assert got.cache_key == im.cache_key
    regions = sorted(p.region for p in packed)  # type: ignore[type-var]
    for (o1, n1), (o2, _) in zip(regions, regions[1:]):
        assert o1 + n1 <= o2  # no two live regions overlap
    for p in packed:
        arena.free(p.region)
    assert arena.used == 0 and arena._free == [(0, arena.size)]  # merged back into one


def test_freed_in_any_order_the_whole_arena_is_free_again(arena: Arena) -> None:
    rng = np.random.default_rng(0)
    sizes = [int(n) * 64 for n in rng.integers(1, 64, 16)]
    blocks = [(arena._alloc(n), n) for n in sizes]
    assert all(off is not None for off, _ in blocks) and arena.used == sum(sizes)
    for i in rng.permutation(len(blocks)):
        arena.free(blocks[i])  # type: ignore[arg-type]
    assert arena.used == 0 and arena._free == [(0, arena.size)]
    assert arena._alloc(arena.size) == 0


def test_an_image_over_the_free_space_travels_whole(arena: Arena) -> None:
    big = TilingConfig(tile_size=448, max_tiles=1, use_thumbnail=False).prepare(picture(1))
    assert sum(a.nbytes for a in arrays(big).values()) > arena.size
    packed = arena.put(big)
    assert packed.layout is None and packed.region is None and arena.view(packed) is big


def test_a_held_image_is_copied_once_and_freed_only_unused(arena: Arena) -> None:
    """``Residents``: a second request about an image reads the same region (no copy); an
    unused image stays until the budget or the arena needs its room; one still held by a
    request is never freed, however full the arena."""
    images = [PLAN.prepare(picture(seed)) for seed in range(4)]
    size = arena.put(images[0]).region[1]  # type: ignore[index]
    arena.free((0, size))
    r = Residents(arena, budget=2 * size)
    a1, a2 = r.hold(images[0]), r.hold(images[0])
    assert a1 is a2 and arena.used == size  # one copy for both requests
    others = [r.hold(im) for im in images[1:]]
    assert arena.used == 4 * size and r.bytes == 4 * size  # all held: none freed
    r.release(a1)
    for p in others:
        r.release(p)
    assert arena.used == 4 * size - 2 * size  # unused over the budget: the oldest went
    assert r.hold(images[0]) is a1  # still held by a2's request: kept, not copied again
    r.release(a1)
    r.release(a2)
    full = Residents(arena, budget=arena.size)  # no budget: only the arena's room evicts
    big = [full.hold(PLAN.prepare(picture(10 + i))) for i in range(arena.size // size)]
    assert all(p.region is not None for p in big[:2]) and full.bytes <= arena.size


def test_an_image_released_and_evicted_leaves_the_arena_whole(arena: Arena) -> None:
    r = Residents(arena, budget=0)
    packed = [r.hold(PLAN.prepare(picture(seed))) for seed in range(5)]
    for p in packed:
        r.release(p)
    assert arena.used == 0 and arena._free == [(0, arena.size)] and r.bytes == 0


def test_every_message_kind_crosses_a_link_as_itself() -> None:
    """The channel's records (``messages.py``), one frozen dataclass per kind, each sent
    over a real ``Link`` (two pipes) and read back equal, of its own type; nothing else is
    a message."""
    import os
    from pathlib import Path

    from vlmbatch.pipeline.hooks import NO_HOOKS
    from vlmbatch.pipeline.questions import Question
    from vlmbatch.server.config import ServerConfig
    from vlmbatch.serving import messages as m
    from vlmbatch.serving.channel import Link

    image = PLAN.prepare(picture(0))
    kinds = [m.Start(ServerConfig().serving, NO_HOOKS, 1),
             m.Ask(7, Question("q", "Is it red?", choices=("a", "b")), m.Packed(image)),
             m.RunBatch("batch_x", Path("/tmp/job")), m.CancelBatch("batch_x"), m.Stop(2.0),
             m.Ready(m.EngineInfo(PLAN, None, None)),
             m.Settled((m.Reply(7, failure=m.Failure(429, "full", code="queue_full")),),
                       m.Counters(1, 2, 3, 4, 5, 6)),
             m.BatchDrained("batch_x", True), m.BatchFailed("batch_x", "why"),
             m.BatchReleased("batch_x")]
    assert all(dataclasses.is_dataclass(k) and type(k).__dataclass_params__.frozen  # type: ignore[attr-defined]
               for k in kinds)
    a_r, b_w = os.pipe()
    b_r, a_w = os.pipe()
    a, b = Link(a_r, a_w), Link(b_r, b_w)
    try:
        for k in kinds:
            a.send(k)
            got = b.recv()
            assert type(got) is type(k)
            if isinstance(k, m.Ask):
                assert (got.rid, got.question) == (k.rid, k.question)
                assert got.image.meta.cache_key == image.cache_key
            elif not isinstance(k, m.Start):
                assert got == k
    finally:
        a.close()
        b.close()
    err = m.Settled((m.Reply(1, failure=m.failure_of(ValueError("x"))),)).answers[0].failure
    assert err is not None and err.status == 500 and isinstance(err.exception(), Exception)
