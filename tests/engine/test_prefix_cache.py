"""Image-aware prefix KV cache: keys, collisions, LRU, and the engine's use of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.prefix_cache import ImageSpan, PrefixCache, block_ids
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.preprocessing.prepare import PreparedImage, prepare

QUESTIONS = ["is there a red shape?", "Does the image contain a circle?", "no", "yes or no"]


@pytest.fixture(scope="module")
def model(random_model_dir):  # noqa: ANN001, ANN201
    return load_model(random_model_dir)


def images(model, sizes=((56, 56), (150, 60), (40, 130), (200, 200)), seed=5) -> list:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    return [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), model.spec.tiling)
            for w, h in sizes]


def margins(engine: TorchEngine, ims: list, qs=QUESTIONS) -> torch.Tensor:  # noqa: ANN001
    reqs = [Request(i, q) for i in range(len(ims)) for q in qs]
    return torch.tensor([s.margin for s in engine.score(ims, reqs)], dtype=torch.float64)


def test_keys_separate_images_with_identical_placeholder_ids() -> None:
    ids = list(range(10)) + [7] * 40 + list(range(10))
    a = block_ids(ids, [ImageSpan(10, 40, "image-a")], 16)
    b = block_ids(ids, [ImageSpan(10, 40, "image-b")], 16)
    assert len(a) == len(b) == 3  # only full blocks
    assert all(x.key != y.key for x, y in zip(a, b))
    assert block_ids(ids, [ImageSpan(10, 40, "image-a")], 16)[2].key == a[2].key
    tail = block_ids(ids, [ImageSpan(10, 40, "image-a")], 16, limit=51, tail=True)
    assert len(tail[-1].ids) == 3 and tail[0].key == a[0].key


def test_token_only_cache_is_the_write_up_bug(model, monkeypatch) -> None:  # noqa: ANN001
    """Keyed by token ids alone, image B is answered with image A's KV. Ours is not."""
    a, b = images(model, sizes=((56, 56), (56, 56)))
    truth = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), [b])
    ours = TorchEngine(model, EngineConfig())
    margins(ours, [a])
    assert torch.allclose(margins(ours, [b]), truth, atol=1e-5)

    monkeypatch.setattr(PreparedImage, "cache_key", property(lambda self: "same-for-all"))
    token_only = TorchEngine(model, EngineConfig())
    got_a = margins(token_only, [a])
    got_b = margins(token_only, [b])
    assert torch.allclose(got_b, got_a)  # B got A's answers
    assert not torch.allclose(got_b, truth, atol=1e-3)


def test_cache_on_equals_cache_off(model) -> None:  # noqa: ANN001
    ims = images(model)
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), ims)
    for bs in (1, 4, 16, 64):
        on = TorchEngine(model, EngineConfig(block_size=bs, max_batch_tokens=400))
        assert (margins(on, ims) - off).abs().max() <= 1e-5
        assert (margins(on, ims) - off).abs().max() <= 1e-5  # second call: all from cache
        assert on.cache is not None and on.cache.stats.hits > 0


def test_k_questions_encode_and_prefill_image_once(model) -> None:  # noqa: ANN001
    (im,) = images(model, sizes=((150, 60),))
    engine = TorchEngine(model, EngineConfig())
    qs = ["red?", "Is there a circle?", "no", "Does the image contain two triangles?",
          "what about blue", "Yes or no: gray?"]  # no shared words after </img>
    k = len(qs)
    engine.score([im], [Request(0, q) for q in qs])
    n_image = im.grid.num_tiles * model.spec.tokens_per_tile
    assert engine.stats.vision_tiles == im.grid.num_tiles
    assert engine.stats.image_tokens_prefilled == n_image
    assert engine.stats.prefill_tokens < engine.stats.prompt_tokens - (k - 1) * n_image + 1
    engine.score([im], [Request(0, "one more?")])  # later call: the image is fully cached
    assert engine.stats.vision_tiles == im.grid.num_tiles
    assert engine.stats.image_tokens_prefilled == n_image


def test_eviction_keeps_results_correct(model) -> None:  # noqa: ANN001
    ims = images(model)
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), ims)
    tiny = TorchEngine(model, EngineConfig(block_size=4, cache_bytes=3_000))
    assert tiny.cache is not None
    assert (margins(tiny, ims) - off).abs().max() <= 1e-5
    assert tiny.cache.stats.evictions > 0
    # under pressure, followers still find their leader's prefix (chunked phases), and the
    # surviving entries are chain heads (tails are evicted first), so hits keep coming
    hits = tiny.cache.stats.hits
    assert hits > 0
    assert (margins(tiny, ims) - off).abs().max() <= 1e-5
    assert tiny.cache.stats.hits > hits


def test_lru_and_collision_check() -> None:
    kv = torch.zeros(1, 2, 1, 4, 2)  # 64 bytes
    cache = PrefixCache(block_size=4, budget_bytes=128)
    a, b, c = (block_ids([i] * 4, [], 4)[0] for i in (1, 2, 3))
    cache.insert(a, kv)
    cache.insert(b, kv)
    assert len(cache.lookup([a])) == 1  # a is now most recent
    cache.insert(c, kv)  # evicts b, the least recent
    assert cache.lookup([b]) == [] and len(cache.lookup([a])) == 1
    assert cache.stats.evictions == 1 and cache.bytes == 128
    chain = block_ids([1] * 8, [], 4)  # two blocks: head, tail
    cache.insert(chain[0], kv)
    cache.insert(chain[1], kv)
    cache.touch([b.key for b in chain])  # head most recent
    cache.insert(c, kv)  # evicts the chain's tail, not its head
    assert len(cache.lookup(chain)) == 1
    forged = type(a)(a.key, a.parent, (9, 9, 9, 9), a.extra)  # same key, other tokens
    assert cache.lookup([forged]) == [] and cache.stats.collisions == 1


def test_pinned_blocks_keep_their_kv_until_unpinned() -> None:
    """The pool reuses slots: what lookup handed out is pinned, so later inserts evict
    around it and the views stay valid; unpinned, it is evictable again."""
    def kv(value: float, n: int = 4) -> torch.Tensor:
        return torch.full((1, 2, 1, n, 2), value)

    cache = PrefixCache(block_size=4, budget_bytes=128)  # two 64-byte slots
    a, b, c, d, e = (block_ids([i] * 4, [], 4)[0] for i in range(1, 6))
    cache.insert(a, kv(1.0))
    cache.insert(b, kv(2.0))
    (held,) = cache.lookup([a])
    cache.insert(c, kv(3.0))  # evicts b
    cache.insert(d, kv(4.0))  # a is pinned: evicts c
    assert torch.equal(held, kv(1.0)) and cache.stats.evictions == 2
    cache.lookup([d])  # now both slots are pinned: nothing can go in
    cache.insert(e, kv(5.0))
    assert cache.lookup([e]) == [] and torch.equal(held, kv(1.0))
    cache.unpin([a.key, d.key])
    cache.unpin([d.key])  # the second lookup of d
    cache.insert(e, kv(5.0))  # a is least recent and free again
    assert cache.lookup([a]) == [] and torch.equal(cache.lookup([e])[0], kv(5.0))
    assert cache.bytes == 128 <= cache.budget_bytes


def test_partial_blocks_chains_larger_than_the_pool_and_bad_shapes() -> None:
    cache = PrefixCache(block_size=4, budget_bytes=2 * 64)
    chain = block_ids([7] * 11, [], 4, tail=True)  # 4 + 4 + 3 tokens: three blocks
    for i, blk in enumerate(chain):  # as the engine inserts a chain: pinned until done
        cache.insert(blk, torch.full((1, 2, 1, len(blk.ids), 2), float(i)), pin=True)
    cache.unpin([b.key for b in chain])
    got = cache.lookup(chain)  # the pool holds two: the head and the next, not the tail
    assert len(got) == 2 and [float(g[0, 0, 0, 0, 0]) for g in got] == [0.0, 1.0]
    small = PrefixCache(block_size=4, budget_bytes=3 * 64)
    small.insert(chain[2], torch.full((1, 2, 1, 3, 2), 9.0))  # a partial block: 3 tokens
    (part,) = small.lookup([chain[2]])
    assert part.shape == (1, 2, 1, 3, 2) and torch.equal(part, torch.full((1, 2, 1, 3, 2), 9.0))
    with pytest.raises(ValueError, match="does not fit"):
        small.insert(chain[0], torch.zeros(2, 2, 1, 4, 2))  # another model's KV
    none = PrefixCache(block_size=4, budget_bytes=63)  # below one slot: caches nothing
    none.insert(chain[0], torch.zeros(1, 2, 1, 4, 2))
    assert none.lookup([chain[0]]) == [] and none.bytes == 0


def test_a_pool_of_nan_garbage_never_reaches_an_answer(model) -> None:  # noqa: ANN001
    """The engine gathers whole slots for a batch and masks what lies past each row's
    prefix. A CUDA pool starts as uninitialised memory, so fill it with NaN: answers and
    greedy text must still equal the cacheless run (without zeroing a partial block's tail on
    insert, NaN reaches every row that reads that block: SDPA's mask adds -inf to NaN)."""
    ims = images(model)
    reqs = [Request(i, q) for i in range(len(ims)) for q in QUESTIONS]
    cfg = dict(max_new_tokens=3, ignore_eos=True)
    off = TorchEngine(model, EngineConfig(prefix_cache=False, **cfg)).score(ims, reqs)
    for bs in (4, 7):  # 7: prefixes end in partial blocks
        on = TorchEngine(model, EngineConfig(block_size=bs, **cfg))
        assert on.cache is not None
        on.cache.pool.fill_(float("nan"))
        for _ in range(2):
            got = on.score(ims, reqs)
            assert [s.text for s in got] == [s.text for s in off]
            assert max(abs(a.margin - b.margin) for a, b in zip(got, off)) <= 1e-5
        assert on.cache.stats.hits > 0


def pins(engine: TorchEngine) -> int:
    assert engine.cache is not None
    return sum(e.pins for e in engine.cache._entries.values())


def test_many_batches_under_a_tight_pool_read_no_reused_slot(model) -> None:  # noqa: ANN001
    """Several batches per phase (small --max-batch-tokens) over a pool of a few slots: the
    later batches' cached KV was looked up before the earlier batches inserted, so only
    pinning keeps it from being overwritten (without it, margins drift by ~4e-3). Greedy
    text too; no pin is left once score returns."""
    ims = images(model)
    qs = QUESTIONS + ["red?", "a circle?", "blue?", "round?"]
    reqs = [Request(i, q) for i in range(len(ims)) for q in qs]
    cfg = dict(max_new_tokens=4, max_batch_tokens=60, ignore_eos=True)
    off = TorchEngine(model, EngineConfig(prefix_cache=False, **cfg)).score(ims, reqs)
    tight = TorchEngine(model, EngineConfig(block_size=4, cache_bytes=3_000, **cfg))
    for _ in range(2):
        on = tight.score(ims, reqs)
        assert [s.text for s in on] == [s.text for s in off]
        assert max(abs(a.margin - b.margin) for a, b in zip(on, off)) <= 1e-5
        assert pins(tight) == 0
    assert tight.cache is not None and tight.cache.stats.hits > 0


def test_an_error_while_inserting_leaves_no_pin(model, monkeypatch) -> None:  # noqa: ANN001
    """The runner keeps the engine after a failed group (e.g. out of memory): pins taken by
    that group's lookups and inserts must all be released, or slots leak for good; and the
    blocks it claimed before the error (their KV never copied in) must not stay cached."""
    ims = images(model)
    engine = TorchEngine(model, EngineConfig(block_size=4, cache_bytes=3_000))
    assert engine.cache is not None
    engine.score(ims, [Request(i, q) for i in range(len(ims)) for q in QUESTIONS])
    real, calls = engine.cache.claim, []

    def failing(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 2:  # the second new image's chain, after the first one's claim
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kw)

    monkeypatch.setattr(engine.cache, "claim", failing)
    more = images(model, seed=6)  # new images: inserts, and lookups of the shared text
    with pytest.raises(RuntimeError, match="simulated"):
        engine.score(more, [Request(i, q) for i in range(len(more)) for q in QUESTIONS])
    assert len(calls) == 2 and pins(engine) == 0
    monkeypatch.setattr(engine.cache, "claim", real)
    off = margins(TorchEngine(model, EngineConfig(prefix_cache=False)), more)
    assert (margins(engine, more) - off).abs().max() <= 1e-5


def test_a_cache_budget_that_cannot_be_allocated_is_a_config_error(model) -> None:  # noqa: ANN001
    from vlmbatch.engine.config import ConfigError

    with pytest.raises(ConfigError, match="--cache-mib .* smaller --cache-mib"):
        TorchEngine(model, EngineConfig(cache_bytes=1 << 52))  # 4 PiB
