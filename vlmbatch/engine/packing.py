"""One row per image: its shared prefix and every question about it in one forward (pure
Python and numpy, no tensors: the planner's half of the torch engine's step).

The questions about one image share a prefix (the chat template's head, the image, and what
they all start with: ``Planner.shared_lengths``). Instead of prefilling it once (leaders) and
then each question after it (followers), a row holds both::

    past (cached, P)  | tail: the prefix's uncached tokens | q1's own | q2's own | ... | pad
    segment:               0                                 1          2              -1

and a block-causal mask (``Decoder.prefill_segments``): the tail is causal over the past and
itself; each question's tokens see the past, the whole tail and their own earlier tokens,
never another question's (the shape of a label set's choices side by side after one prompt,
``engine/choices.py``). Each token keeps its position in its own prompt, so question k's
logits at its last token are those of its prompt prefilled alone. The tail's K/V are the
prefix's and go into the cache as before (``Row.plan.blocks``).

A step is the rows that fit the token budget, ``B * (P_max + T_max) <= max_batch_tokens``
(``steps``), across images and groups: for easy-vqa's 16 images of ~7 questions each, one
forward where the leaders/followers phases took two or more per chunk.

What stays on two passes (``rows`` leaves it in ``rest``, for ``TorchEngine``'s phases,
which then find the prefix the rows cached): a question that wants generated text or a
label set (their continuations read one prompt's K/V per row), the questions of an image
that do not fit one row in the budget (they follow it, reading its cached prefix), a
decoder with linear-attention layers (``docs/hybrid_cache.md``), and a prompt past a
dynamic rotary's trained length (its base depends on its own length, one per row here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlmbatch.engine.planner import Plan, Planner, Prefix, groups
from vlmbatch.engine.prefix_cache import BlockId
from vlmbatch.engine.records import Item, Request
from vlmbatch.models.base import Prompt


@dataclass
class Row:
    """One image's prefix (``plan``: its group's first prompt planned through the shared
    prefix: the cached part as pinned slots and ``past_len``, the blocks to cache) and the
    questions after it (``members``: request indices; ``lengths``: each one's own tokens,
    ``len(ids) - shared``)."""
    plan: Plan
    shared: int
    members: list[int]
    lengths: list[int]

    @property
    def tail(self) -> int:
        """The prefix's tokens computed in this row (after the cached ``past_len``)."""
        return self.shared - self.plan.past_len

    @property
    def new_len(self) -> int:
        return self.tail + sum(self.lengths)


@dataclass(frozen=True)
class StepArrays:
    """A step's host inputs (B rows, T = the longest row's new tokens, Q questions):
    ``tokens [3, B, T]`` int64: token ids (padding 0), 1-D positions (each token's in its
    own prompt), segments (0 tail, k >= 1 the row's k-th question, -1 padding); ``at [Q]``:
    each question's last token as ``row * T + t``, rows' questions in order; ``image_at``:
    per row with uncached image tokens, (row, first column, first image token);
    ``image_index``: where those tokens go, as ``row * T + t``, rows in order."""
    tokens: np.ndarray
    at: list[int]
    image_at: list[tuple[int, int, int]]
    image_index: np.ndarray


def steps(rows: list[Row], max_batch_tokens: int) -> list[list[Row]]:
    """Rows sorted by new length (longest first), cut so B * (P + T) <= the budget (one row
    alone may exceed it only if ``rows`` let it: they do not)."""
    rows = sorted(rows, key=lambda r: r.new_len, reverse=True)
    out: list[list[Row]] = []
    cur: list[Row] = []
    past = 0
    for r in rows:
        width = max(past, r.plan.past_len) + (cur[0] if cur else r).new_len
        if cur and (len(cur) + 1) * width > max_batch_tokens:
            out.append(cur)
            cur, past = [], 0
        cur.append(r)
        past = max(past, r.plan.past_len)
    if cur:
        out.append(cur)
    return out


def make_rows(planner: Planner, requests: list[Request], prompts: list[Prompt],
              images: Sequence[Item], shared: list[int],
              prefixes: dict[Prefix, list[BlockId]], packable: list[bool]
              ) -> tuple[list[Row], list[int]]:
    """One row per group (``planner.groups``: an image and what its prompts say before
    it) of its ``packable`` requests, its prefix planned (cached part pinned: release the
    rows' plans once their step has run); and the requests left for the phases (module
    docstring), in order: the others, and what a row cannot hold in the budget."""
    rows: list[Row] = []
    rest: list[int] = []
    for group in groups(requests, prompts).values():
        members = [i for i in group if packable[i]]
        rest += [i for i in group if not packable[i]]
        if not members:
            continue
        lead = members[0]
        end = shared[lead]  # the same for the group's prompts
        lengths = [len(prompts[i].ids) - end for i in members]
        n = int(np.searchsorted(np.cumsum(lengths), planner.max_batch_tokens - end, "right"))
        if n == 0:  # not even one question fits beside the prefix
            rest += members
            continue
        plan = planner.plan(lead, prompts[lead], images[requests[lead].image], prefixes,
                            shared=end)
        rows.append(Row(plan, end, members[:n], lengths[:n]))
        rest += members[n:]
    return rows, sorted(rest)


def arrays(step: list[Row], prompts: list[Prompt]) -> StepArrays:
    """The step's host inputs (``StepArrays``), built per segment, not per token."""
    b, t = len(step), max(r.new_len for r in step)
    tokens = np.zeros((3, b, t), dtype=np.int64)
    tokens[2] = -1
    at: list[int] = []
    image_at: list[tuple[int, int, int]] = []
    dst: list[np.ndarray] = []
    for j, r in enumerate(step):
        lead = r.plan.prompt
        past = r.plan.past_len
        tail = r.tail
        row = tokens[:, j]
        row[0, :tail] = lead.ids[past: r.shared]
        row[1, :tail] = np.arange(past, r.shared)
        row[2, :tail] = 0
        col = tail
        for k, (i, n) in enumerate(zip(r.members, r.lengths), 1):
            row[0, col: col + n] = prompts[i].ids[r.shared:]
            row[1, col: col + n] = np.arange(r.shared, r.shared + n)
            row[2, col: col + n] = k
            col += n
            at.append(j * t + col - 1)
        first = max(lead.image_start, past)  # the image tokens this row computes
        end = lead.image_start + lead.image_len
        if first < end:
            image_at.append((j, first - past, first - lead.image_start))
            dst.append(np.arange(j * t + first - past, j * t + end - past))
    return StepArrays(tokens, at, image_at,
                      np.concatenate(dst) if dst else np.zeros(0, dtype=np.int64))
