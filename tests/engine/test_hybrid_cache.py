"""The image prefix of a hybrid decoder (Qwen3.5: linear-attention and full layers) in the
prefix cache (``docs/hybrid_cache.md``): state snapshots in the cache's slots (round trip,
pins, whole-entry eviction, collisions, the budget), and through the engine: K questions
resuming from one image's snapshot = a fresh prefill per question, the tokens that saves,
a bounded cache, and faults in the restored state that the equality catches.

Engine tests: fp32, CPU, the tiny random Qwen3.5 of ``tests/models/qwen_vl_helpers.py``
(every parameter perturbed, biases included; its decays are slow, so a lost state shows).
Tolerance: margins cache on = off 1e-5; a fault moves some margin by more than 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.qwen_vl_helpers import save_engine_checkpoint
from vlmbatch.engine import model_runner
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.prefix_cache import PrefixCache, block_ids, state_key
from vlmbatch.engine.records import Request
from vlmbatch.engine.state_snapshots import StateCodec
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import ImageOptions, LoadedModel
from vlmbatch.preprocessing.prepare import PreparedImage

QUESTIONS = ["is there a red shape?", "Does the image contain a circle?", "round?"]
SIZES = [(200, 90), (30, 170)]  # (width, height)


def test_state_snapshot_round_trip_pins_and_whole_eviction() -> None:
    """A snapshot over two slots reads back bit for bit and stays while pinned; blocks and
    snapshots share the slots and the LRU order; a snapshot is evicted whole (both slots
    freed at once); nothing goes in when pins leave no room; a hit is checked against its
    prefix's tokens; ``bytes`` stays within the budget."""
    cache = PrefixCache(block_size=4, budget_bytes=4 * 64)
    cache.allocate((1, 2, 1, 2), torch.float32, "cpu")  # 64-byte slots, four of them
    codec = StateCodec([((5, 3), torch.float32), ((2, 2, 3), torch.float32)])  # 108 bytes
    assert cache.state_slots(codec.nbytes) == 2
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(1, 5, 3, generator=g), torch.randn(1, 2, 2, 3, generator=g)]
    data = codec.pack(states)[0]
    a, b, c, d = (block_ids([i] * 4, [], 4)[0] for i in (1, 2, 3, 4))
    kv = torch.zeros(1, 2, 1, 4, 2)
    assert state_key(a) != a.key and state_key(a) != state_key(b)
    assert cache.insert_state(a, data)
    held = cache.lookup_state(a)  # pinned
    assert len(held) == 2 and cache.bytes == 128

    def read(slots: list[int]) -> list[torch.Tensor]:
        return codec.unpack(cache.arena[torch.tensor([slots])].view(1, -1))

    assert all(torch.equal(x, y) for x, y in zip(read(held), states))
    cache.insert(b, kv)
    cache.insert(c, kv)
    cache.insert(d, kv)  # no free slot: the oldest unpinned entry (b) goes, not the snapshot
    assert cache.lookup_slots([b]) == [] and cache.stats.evictions == 1
    assert cache.insert_state(b, 2 * data)  # evicts c and d for its two slots
    assert cache.stats.evictions == 3 and cache.bytes == 4 * 64 == cache.budget_bytes
    assert all(torch.equal(x, y) for x, y in zip(read(held), states))  # a's kept its bytes
    cache.lookup_state(b)  # every slot pinned now: nothing goes in
    assert not cache.insert_state(c, data) and not cache.insert(c, kv)
    assert cache.stats.evictions == 3
    cache.unpin([state_key(a)])
    assert cache.insert(c, kv) and cache.insert(d, kv)  # a evicted whole: two slots at once
    assert cache.stats.evictions == 4 and cache.lookup_state(a) == []
    forged = type(b)(b.key, b.parent, (9, 9, 9, 9), b.extra)  # same key, other tokens
    assert cache.lookup_state(forged) == [] and cache.stats.collisions == 1
    assert cache.bytes <= cache.budget_bytes


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(save_engine_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5")))


@pytest.fixture(scope="module")
def case(qwen3_5: LoadedModel) -> tuple[list[PreparedImage], torch.Tensor]:
    """The images, and their margins without the cache (the truth every test compares to)."""
    plan = qwen3_5.family.image_plan(qwen3_5.spec, ImageOptions("reduced", None, 1.0, None))
    rng = np.random.default_rng(1)
    ims = [plan.prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]
    return ims, margins(TorchEngine(qwen3_5, EngineConfig(prefix_cache=False)), ims)


def requests(n_images: int) -> list[Request]:
    return [Request(i, q) for i in range(n_images) for q in QUESTIONS]


def margins(engine: TorchEngine, ims: list[PreparedImage]) -> torch.Tensor:
    scores = engine.score(ims, requests(len(ims)))
    return torch.tensor([s.margin for s in scores], dtype=torch.float64)


def test_snapshot_reuse_equals_a_fresh_prefill_per_question(
        qwen3_5: LoadedModel, case: tuple[list[PreparedImage], torch.Tensor]) -> None:
    """Each image's first question prefills its whole prompt and takes the snapshot at the
    prefix's end inside that forward (one forward per question, none prefix-only); its
    other questions resume from the snapshot and the full layers' blocks: margins = cache
    off, which prefills every question's whole prompt. A second call finds every prefix and
    prefills the questions only."""
    ims, truth = case
    on = TorchEngine(qwen3_5, EngineConfig(block_size=16))
    assert on.cache is not None and on.runner.codec is not None
    assert (margins(on, ims) - truth).abs().max() <= 1e-5
    prompts = [qwen3_5.prompts.build(r.question, ims[r.image]) for r in requests(len(ims))]
    tails = sum(len(p.ids) - p.prefix_len for p in prompts)
    prefixes = sum(p.prefix_len for p in prompts[:: len(QUESTIONS)])
    assert on.stats.prefill_tokens == tails + prefixes  # cache off: tails + K * prefixes
    assert on.cache.stats.state_hits == len(prompts) - len(ims)  # the first takes it
    assert on.cache.stats.state_inserts == len(ims)
    assert (margins(on, ims) - truth).abs().max() <= 1e-5
    assert on.stats.prefill_tokens == 2 * tails + prefixes
    assert on.cache.stats.state_hits == 2 * len(prompts) - len(ims)


@pytest.mark.parametrize("fault", ["zero state", "zero conv state", "other row's state"])
def test_a_wrong_restored_state_is_caught(qwen3_5: LoadedModel,
                                          case: tuple[list[PreparedImage], torch.Tensor],
                                          fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above fails when the resumed rows get a wrong linear-layer state:
    none (the K/V of the full layers alone), the conv state lost, or rows' states
    swapped."""
    ims, truth = case
    restore = model_runner.restore

    def broken(*args: object) -> list[torch.Tensor]:
        states = restore(*args)  # type: ignore[arg-type]
        if fault == "zero state":
            return [torch.zeros_like(t) for t in states]
        if fault == "zero conv state":
            return [torch.zeros_like(t) if k % 2 == 0 else t for k, t in enumerate(states)]
        return [t.roll(1, 0) for t in states]

    monkeypatch.setattr(model_runner, "restore", broken)
    got = margins(TorchEngine(qwen3_5, EngineConfig(block_size=16)), ims)
    assert (got - truth).abs().max() > 1e-3


def test_a_small_cache_mib_bounds_snapshots_and_blocks(
        qwen3_5: LoadedModel, case: tuple[list[PreparedImage], torch.Tensor]) -> None:
    """A budget of one image's prefix and snapshot and a slot: one image per chunk, the
    earlier image's snapshot and blocks evicted for the next, the bytes in use within the
    budget, and every answer still equal to the cacheless run."""
    ims, truth = case
    probe = TorchEngine(qwen3_5, EngineConfig(block_size=16))
    assert probe.cache is not None and probe.runner.codec is not None
    prefix = max(qwen3_5.prompts.build("q", im).prefix_len for im in ims)
    need = (-(-prefix // 16) + probe.cache.state_slots(probe.runner.codec.nbytes))
    budget = (need + 1) * probe.cache.slot_bytes
    tight = TorchEngine(qwen3_5, EngineConfig(block_size=16, cache_bytes=budget))
    assert (margins(tight, ims) - truth).abs().max() <= 1e-5
    assert tight.cache is not None and tight.cache.stats.evictions > 0
    assert tight.cache.stats.state_hits > 0 and tight.cache.bytes <= budget


def test_an_embedded_image_answers_from_its_snapshot(
        qwen3_5: LoadedModel, case: tuple[list[PreparedImage], torch.Tensor]) -> None:
    """An image embedded first (``image-mean``: its prompt ends at the image's end marker,
    the snapshot is taken in that forward) then asked its questions: every question
    resumes from the snapshot (no prefix prefilled again), the margins as without the
    cache; the vectors as without the cache."""
    from vlmbatch.engine.config import EmbedConfig
    from vlmbatch.engine.records import EmbedRequest

    ims, truth = case
    reqs = [EmbedRequest(i, None) for i in range(len(ims))]
    cfg = EmbedConfig(pooling="image-mean")
    on = TorchEngine(qwen3_5, EngineConfig(block_size=16))
    off = TorchEngine(qwen3_5, EngineConfig(prefix_cache=False))
    vectors = on.embed(ims, reqs, cfg)
    for a, b in zip(vectors, off.embed(ims, reqs, cfg)):
        assert float(np.abs(a.values - b.values).max()) <= 1e-5
    assert on.cache is not None and on.cache.stats.state_inserts == len(ims)
    before = on.stats.prefill_tokens
    assert (margins(on, ims) - truth).abs().max() <= 1e-5
    prompts = [qwen3_5.prompts.build(r.question, ims[r.image]) for r in requests(len(ims))]
    assert on.cache.stats.state_hits == len(prompts)
    assert on.stats.prefill_tokens - before == sum(len(p.ids) - p.prefix_len for p in prompts)


def test_a_shared_instruction_takes_two_snapshots(
        qwen3_5: LoadedModel, case: tuple[list[PreparedImage], torch.Tensor]) -> None:
    """Questions that share their first words after the image: the first question's
    forward takes two snapshots, at the image's end and where the prompts start to differ;
    the others resume from the second (prefilling only what differs); a later call asking
    one question alone resumes from the first. Margins as without the cache."""
    ims, _ = case
    shared = ["Look closely. Is there a red shape?", "Look closely. Is it round?"]
    reqs = [Request(i, q) for i in range(len(ims)) for q in shared]
    alone = [Request(i, "Is it blue?") for i in range(len(ims))]
    off = TorchEngine(qwen3_5, EngineConfig(prefix_cache=False))
    want = [s.margin for s in off.score(ims, reqs) + off.score(ims, alone)]
    on = TorchEngine(qwen3_5, EngineConfig(block_size=16))
    got = [s.margin for s in on.score(ims, reqs)]
    assert on.cache is not None and on.cache.stats.state_inserts == 2 * len(ims)
    prompts = [qwen3_5.prompts.build(r.question, ims[r.image]) for r in reqs]
    common = [next(k for k, (x, y) in enumerate(zip(a.ids, b.ids)) if x != y)
              for a, b in zip(prompts[::2], prompts[1::2])]
    assert all(c > p.prefix_len + 3 for c, p in zip(common, prompts[::2]))
    assert on.stats.prefill_tokens == sum(len(a.ids) + len(b.ids) - c for a, b, c in
                                          zip(prompts[::2], prompts[1::2], common))
    before, hits = on.stats.prefill_tokens, on.cache.stats.state_hits
    got += [s.margin for s in on.score(ims, alone)]
    assert on.cache.stats.state_hits == hits + len(ims)
    singles = [qwen3_5.prompts.build(r.question, ims[r.image]) for r in alone]
    assert on.stats.prefill_tokens - before == sum(len(p.ids) - p.prefix_len for p in singles)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
