"""The torch engine's planner: pure Python, no tensors (nano-vllm's ``Scheduler`` /
``BlockManager`` half). For one ``score`` call it decides

- the shared prefixes: the prompts about one image that render the same text before it (the
  same system turn, or none) form a group; the group's shared prefix runs to the first token
  where its prompts differ (so an instruction they all start with is shared too), at least
  through the image's end marker and short of each prompt's last token (``shared_lengths``);
- the phases: with the prefix cache, the first question of every group runs first (it
  computes and caches the group's prefix), then all the others (they hit it), in chunks of
  groups whose prefixes fit in half the cache budget; without a cache, one phase;
- each prompt's plan: the longest cached prefix (full blocks, then the partial block that
  ends the shared prefix), as pinned pool slots, and the blocks its prefill must insert;
- the batches: plans sorted by new length, cut so ``B * (P_max + T_max) <=
  max_batch_tokens``.

Invariant: every slot a plan holds is pinned in the cache until ``release`` (after its batch
has gathered the slots' KV, or in a ``finally`` on error), so a later insert cannot reuse it.

A decoder with linear-attention layers (Qwen3.5; ``state_bytes`` > 0: the bytes of one row's
states, ``docs/hybrid_cache.md``) can resume only where a state snapshot was taken. Its plans
reuse the whole shared prefix (every block and the snapshot at its end) or nothing; a plan
that finds nothing prefills its whole prompt and takes the snapshots inside that forward
(``Plan.snapshots``: the runner asks the decoder for the linear layers' state there too):
at the end of the shared prefix, and, when that runs past the image, also at the image's
end marker (where a later call's prompt alone resumes, as the image-end block serves it
above). The prefix's blocks are cached with them, so the followers of its phase, and later
calls, resume there. The phases are the same as without linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmbatch.engine.prefix_cache import (
    BlockId,
    BlockKey,
    ImageSpan,
    PrefixCache,
    block_ids,
    state_key,
)
from vlmbatch.engine.records import Item, MediaItem, Request
from vlmbatch.models.base import Prompt

# a shared prefix, as the planner memoises its blocks within a call: the image's cache key,
# the ids before the image, the ids after it through the end of the shared prefix
Prefix = tuple[str, tuple[int, ...], tuple[int, ...]]


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
    # linear-attention state (module docstring): the shared prefix's last block (its
    # snapshot's key), the snapshot's pinned slots if one is reused, the snapshots to take
    # in this plan's own forward (prompt position, the last block of the prefix it ends)
    state_tail: BlockId | None = None
    state_slots: list[int] = field(default_factory=list)
    snapshots: list[tuple[int, BlockId]] = field(default_factory=list)

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

    def shared_lengths(self, requests: list[Request], prompts: list[Prompt]) -> list[int]:
        """Each prompt's shared prefix length (module docstring): its group's common prefix,
        within ``[prefix_len, len(ids) - 1]``; ``prefix_len`` for a prompt alone."""
        out = [p.prefix_len for p in prompts]
        for group in groups(requests, prompts).values():
            if len(group) < 2:
                continue
            ids = [prompts[i].ids for i in group]
            first = ids[0]
            lo = prompts[group[0]].prefix_len
            n = min([len(x) for x in ids]) - 1
            for x in ids[1:]:  # the common prefix, one comparison per token
                k = lo
                while k < n and x[k] == first[k]:
                    k += 1
                n = k
            for i in group:
                out[i] = max(n, lo)
        return out

    def phases(self, requests: list[Request], prompts: list[Prompt],
               shared: list[int]) -> list[list[int]]:
        """Leaders (first question of each group) before followers, in chunks of groups whose
        prefixes (``shared``) fit in half the cache budget, so a leader's blocks are still
        cached when its followers look for them."""
        if self.cache is None:
            return [list(range(len(requests)))]
        phases = []
        for chunk in self._chunks(requests, prompts, shared):
            phases.append([reqs[0] for reqs in chunk])
            phases.append([i for reqs in chunk for i in reqs[1:]])
        return [p for p in phases if p]

    def _chunks(self, requests: list[Request], prompts: list[Prompt],
                shared: list[int]) -> list[list[list[int]]]:
        """Groups (``groups``) in chunks whose prefixes (a slot per block of ``shared``, the
        partial one included, and a state snapshot's slots) fit half the cache budget."""
        assert self.cache is not None
        chunks: list[list[list[int]]] = [[]]
        used = 0
        bs = self.cache.block_size
        state = self.cache.state_slots(self.state_bytes) if self.state_bytes else 0
        for reqs in groups(requests, prompts).values():
            snaps = 2 if shared[reqs[0]] > prompts[reqs[0]].prefix_len else 1
            need = (-(-shared[reqs[0]] // bs) + snaps * state) * self.cache.slot_bytes
            if chunks[-1] and used + need > self.cache.budget_bytes // 2:
                chunks.append([])
                used = 0
            chunks[-1].append(reqs)
            used += need
        return chunks

    def plan(self, req: int, prompt: Prompt, image: Item | None,
             prefixes: dict[Prefix, list[BlockId]], reuse_limit: int | None = None,
             shared: int | None = None) -> Plan:
        """Find the cached part of the prompt's shared prefix (its first ``shared`` tokens,
        by default through the image's end marker); ``prefixes`` memoises the block ids per
        prefix for the call. ``reuse_limit``: only blocks ending at or before that position
        may come from the cache (an embedding needs the hidden states, not just the KV, from
        there on); the rest are computed and cached anew.

        Only the shared prefix is cached: the blocks after it hold what the prompt's group
        does not share. The prefix's last block may be partial, so a hit covers every shared
        token, not only the full blocks. A prompt without an image (a text to embed) is never
        cached.
        """
        if image is None:
            return Plan(req, prompt, ImageSpan(0, 0, ""))
        span = ImageSpan(prompt.image_start, prompt.image_len, image.cache_key)
        plan = Plan(req, prompt, span)
        if self.cache is None:
            return plan
        limit = prompt.prefix_len if shared is None else shared
        end = prompt.image_start + prompt.image_len
        key = (image.cache_key, prompt.ids[: prompt.image_start], prompt.ids[end:limit])
        blocks = prefixes.get(key)
        if blocks is None:  # same for every question of the group
            blocks = block_ids(prompt.ids, key_spans(prompt, image, span),
                               self.cache.block_size, limit=limit, tail=True)
            prefixes[key] = blocks
        plan.chain = [b.key for b in blocks]
        usable = blocks if reuse_limit is None else _ending_by(blocks, reuse_limit)
        plan.slots = self.cache.lookup_slots(usable)
        if self.state_bytes and self._resume(plan, blocks):
            return plan
        found = len(plan.slots)
        plan.past_len = sum([len(b.ids) for b in blocks[:found]])
        bs = self.cache.block_size
        plan.blocks = [(k * bs, b) for k, b in enumerate(blocks[found:], found)]
        start = prompt.prefix_len // bs * bs
        if limit > prompt.prefix_len and prompt.prefix_len % bs and start >= plan.past_len:
            # also the block that ends at the image's end marker: a later call's prompt
            # alone shares only through there, and finds its whole image cached
            plan.blocks.append((start, self._image_end(prompt, span, prefixes, key, image)))
        if self.state_bytes:  # nothing found (``_resume``): snapshots in this forward
            plan.snapshots = [(limit, blocks[-1])]
            if limit > prompt.prefix_len:  # and where a prompt alone resumes
                plan.snapshots.insert(0, (prompt.prefix_len,
                                          self._image_end(prompt, span, prefixes, key, image)))
        return plan

    def _image_end(self, prompt: Prompt, span: ImageSpan, prefixes: dict[Prefix, list[BlockId]],
                   key: Prefix, item: Item) -> BlockId:
        """The last block of the chain through the image's end marker (memoised): the
        full blocks before it are the shared chain's (``prefixes[key]``)."""
        end = prompt.image_start + prompt.image_len
        own = (key[0], key[1], prompt.ids[end: prompt.prefix_len])
        if own not in prefixes:
            assert self.cache is not None
            full = prompt.prefix_len // self.cache.block_size
            prefixes[own] = block_ids(prompt.ids, key_spans(prompt, item, span),
                                      self.cache.block_size,
                                      limit=prompt.prefix_len, tail=True,
                                      head=prefixes[key][:full])
        return prefixes[own][-1]

    def _resume(self, plan: Plan, blocks: list[BlockId]) -> bool:
        """For a decoder with linear layers: whether the whole shared prefix is cached, every
        block found and usable and the snapshot at its end (the plan then resumes there,
        pinned); otherwise nothing is kept (K/V without the state where they end is of no
        use) and the plan prefills from the start (module docstring)."""
        assert self.cache is not None
        plan.state_tail = blocks[-1]
        if len(plan.slots) == len(blocks):
            plan.state_slots = self.cache.lookup_state(blocks[-1])
        if plan.state_slots:
            plan.past_len = sum(len(b.ids) for b in blocks)
            return True
        self.cache.unpin(plan.chain[: len(plan.slots)])
        plan.slots = []
        return False

    def batches(self, plans: list[Plan]) -> list[list[Plan]]:
        """Plans sorted by new length (longest first), cut so B * (P + T) <=
        max_batch_tokens. A plan with no new token (an embedding prompt whose every token
        is cached) needs no forward and is left out."""
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


def key_spans(prompt: Prompt, item: Item, span: ImageSpan) -> list[ImageSpan]:
    """The spans a prompt's block keys carry: its one image's, or each part's of a
    ``MediaItem`` (first run through last, keyed by the part's content), so two items
    sharing their first part share the blocks before the second."""
    if not isinstance(item, MediaItem):
        return [span]
    return [ImageSpan(runs[0][0], runs[-1][0] + runs[-1][1] - runs[0][0], part.cache_key)
            for runs, part in zip(prompt.parts, item.parts)]


def groups(requests: list[Request], prompts: list[Prompt]
            ) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """Request indices by (image, the prompt's ids before the image), in first-seen order."""
    out: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, (r, p) in enumerate(zip(requests, prompts)):
        out.setdefault((r.image, p.ids[: p.image_start]), []).append(i)
    return out


def _ending_by(blocks: list[BlockId], limit: int) -> list[BlockId]:
    """The leading blocks that end at or before token position ``limit``."""
    out, end = [], 0
    for b in blocks:
        end += len(b.ids)
        if end > limit:
            break
        out.append(b)
    return out
