"""The torch engine's planner: pure Python, no tensors (nano-vllm's ``Scheduler`` /
``BlockManager`` half). For one ``score`` call it decides

- the phases: with the prefix cache, the first question of every image runs first (it
  computes and caches the image's prefix), then all the others (they hit it), in chunks of
  images whose prefixes fit in half the cache budget; without a cache, one phase;
- each prompt's plan: the longest cached prefix (full blocks, then the partial block that
  ends the shared prefix at the image's end marker), as pinned pool slots, and the blocks
  its prefill must insert;
- the batches: plans sorted by new length, cut so ``B * (P_max + T_max) <=
  max_batch_tokens``.

Invariant: every slot a plan holds is pinned in the cache until ``release`` (after its batch
has gathered the slots' KV, or in a ``finally`` on error), so a later insert cannot reuse it.

A decoder with linear-attention layers (Qwen3.5; ``state_bytes`` > 0: the bytes of one row's
states, ``docs/hybrid_cache.md``) can resume only where a state snapshot was taken: at the end
of a shared prefix. Its plans reuse the whole prefix (every block and the snapshot) or nothing;
only a plan whose prompt ends at the prefix (``prefix_phases``' first phase of each chunk)
caches blocks and a snapshot, so its followers, and its own full prompt, resume there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmbatch.models.base import Prompt
from vlmbatch.pipeline.prefix_cache import (
    BlockId,
    BlockKey,
    ImageSpan,
    PrefixCache,
    block_ids,
    state_key,
)
from vlmbatch.pipeline.records import Request
from vlmbatch.preprocessing.prepare import PreparedImage


@dataclass
class Plan:
    req: int  # index into the call's requests
    prompt: Prompt
    span: ImageSpan
    # cache pool slots of the cached part of the prefix, in order; pinned until release
    slots: list[int] = field(default_factory=list)
    past_len: int = 0
    blocks: list[tuple[int, BlockId]] = field(default_factory=list)  # (start, block) to cache
    chain: list[BlockKey] = field(default_factory=list)  # keys of the whole shared prefix
    # linear-attention state (module docstring): the prefix's last block (its snapshot's
    # key), the snapshot's pinned slots if one is reused, whether to take one
    state_tail: BlockId | None = None
    state_slots: list[int] = field(default_factory=list)
    snapshot: bool = False

    @property
    def new_len(self) -> int:
        return len(self.prompt.ids) - self.past_len

    @property
    def needs_image(self) -> bool:
        """Whether some image tokens are not cached (its image must be encoded)."""
        return self.past_len < self.span.start + self.span.length


class Planner:
    def __init__(self, cache: PrefixCache | None, max_batch_tokens: int,
                 state_bytes: int = 0) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.state_bytes = state_bytes  # one row's linear-layer states (0: none)

    def phases(self, requests: list[Request], prompts: list[Prompt]) -> list[list[int]]:
        """Leaders (first question of each image) before followers, in chunks of images whose
        prefixes fit in half the cache budget, so a leader's blocks are still cached when its
        followers look for them."""
        if self.cache is None:
            return [list(range(len(requests)))]
        phases = []
        for chunk in self._chunks(requests, prompts):
            phases.append([reqs[0] for reqs in chunk])
            phases.append([i for reqs in chunk for i in reqs[1:]])
        return [p for p in phases if p]

    def prefix_phases(self, requests: list[Request],
                      prompts: list[Prompt]) -> list[tuple[list[int], list[int]]]:
        """With linear-attention layers (module docstring): per chunk of images, (the first
        request of each image, to prefill through its shared prefix only and snapshot it;
        every request of the chunk, which then resume after that prefix)."""
        assert self.cache is not None
        return [([reqs[0] for reqs in chunk], [i for reqs in chunk for i in reqs])
                for chunk in self._chunks(requests, prompts)]

    def _chunks(self, requests: list[Request], prompts: list[Prompt]) -> list[list[list[int]]]:
        """Images in chunks whose prefixes (a slot per block, the partial one included, and
        the state snapshot's slots) fit half the cache budget: per image its requests."""
        assert self.cache is not None
        by_image: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_image.setdefault(r.image, []).append(i)
        chunks: list[list[list[int]]] = [[]]
        used = 0
        bs = self.cache.block_size
        state = self.cache.state_slots(self.state_bytes)
        for reqs in by_image.values():
            need = (-(-prompts[reqs[0]].prefix_len // bs) + state) * self.cache.slot_bytes
            if chunks[-1] and used + need > self.cache.budget_bytes // 2:
                chunks.append([])
                used = 0
            chunks[-1].append(reqs)
            used += need
        return chunks

    def plan(self, req: int, prompt: Prompt, image: PreparedImage | None,
             prefixes: dict[str, list[BlockId]], reuse_limit: int | None = None) -> Plan:
        """Find the cached part of the prompt's shared prefix (up to and with the image's end
        marker); ``prefixes`` memoises the block ids per image for the call. ``reuse_limit``:
        only blocks ending at or before that position may come from the cache (an embedding
        needs the hidden states, not just the KV, from there on); the rest are computed and
        cached anew.

        Only the shared prefix is cached: the blocks after it hold the question, which the
        next request about the same image does not share. The prefix's last block may be
        partial, so a hit covers every image token, not only the full blocks. A prompt
        without an image (a text to embed) is never cached.
        """
        if image is None:
            return Plan(req, prompt, ImageSpan(0, 0, ""))
        span = ImageSpan(prompt.image_start, prompt.image_len, image.cache_key)
        plan = Plan(req, prompt, span)
        if self.cache is None:
            return plan
        blocks = prefixes.get(image.cache_key)
        if blocks is None:  # same for every question about this image
            blocks = block_ids(prompt.ids, [span], self.cache.block_size,
                               limit=prompt.prefix_len, tail=True)
            prefixes[image.cache_key] = blocks
        plan.chain = [b.key for b in blocks]
        usable = blocks if reuse_limit is None else _ending_by(blocks, reuse_limit)
        plan.slots = self.cache.lookup_slots(usable)
        if self.state_bytes:
            return self._plan_state(plan, blocks)
        plan.past_len = sum(len(b.ids) for b in blocks[: len(plan.slots)])
        plan.blocks = [(k * self.cache.block_size, b)
                       for k, b in enumerate(blocks) if k >= len(plan.slots)]
        return plan

    def _plan_state(self, plan: Plan, blocks: list[BlockId]) -> Plan:
        """``plan`` for a decoder with linear layers: the whole prefix from the cache (every
        block found and usable, and the snapshot at its end) or none of it; blocks and a
        snapshot cached only by a prompt that ends at its prefix (module docstring)."""
        assert self.cache is not None
        plan.state_tail = blocks[-1]
        if len(plan.slots) == len(blocks):
            plan.state_slots = self.cache.lookup_state(blocks[-1])
        if not plan.state_slots:  # K/V without the state where they end is of no use
            self.cache.unpin(plan.chain[: len(plan.slots)])
            plan.slots = []
            plan.snapshot = len(plan.prompt.ids) == plan.prompt.prefix_len
            if plan.snapshot:
                plan.blocks = [(k * self.cache.block_size, b) for k, b in enumerate(blocks)]
            return plan
        plan.past_len = plan.prompt.prefix_len
        return plan

    def batches(self, plans: list[Plan]) -> list[list[Plan]]:
        """Plans sorted by new length (longest first), cut so B * (P + T) <=
        max_batch_tokens. A plan with no new token (a prefix-only prompt whose prefix is
        cached, ``prefix_phases``) needs no forward and is left out."""
        plans = sorted((p for p in plans if p.new_len), key=lambda p: p.new_len, reverse=True)
        batches: list[list[Plan]] = []
        cur: list[Plan] = []
        for p in plans:
            width = max([q.past_len for q in cur] + [p.past_len]) + (cur[0] if cur else p).new_len
            if cur and (len(cur) + 1) * width > self.max_batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(p)
        if cur:
            batches.append(cur)
        return batches

    def release(self, plans: list[Plan]) -> None:
        """Unpin the cached blocks these plans looked up (once: ``slots`` is emptied)."""
        if self.cache is None:
            return
        for p in plans:
            if p.slots:
                self.cache.unpin(p.chain[: len(p.slots)])
                p.slots = []
            if p.state_slots:
                assert p.state_tail is not None
                self.cache.unpin([state_key(p.state_tail)])
                p.state_slots = []


def _ending_by(blocks: list[BlockId], limit: int) -> list[BlockId]:
    """The leading blocks that end at or before token position ``limit``."""
    out, end = [], 0
    for b in blocks:
        end += len(b.ids)
        if end > limit:
            break
        out.append(b)
    return out
