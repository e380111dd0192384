"""A label set's log-likelihoods after a prefill (``ModelRunner.prefill``): every choice's
first token from the prompt's logits, then, for exact scoring, one continuation forward that
scores every later token of every choice.

The continuation holds one row per prompt with all its choices side by side: choice c's
tokens 1..n-1 at positions L..L+n-2 after the prompt's L tokens, each attending to the
prompt's KV (cached past and the prefill's new tokens, ``AfterPrefill.keys``) and to its own
choice's earlier tokens only (``Decoder.extend`` with a block-causal mask). So the prompt and
its image are prefilled once, its KV is read once per row and never copied per choice, and
each choice adds only its own tokens:

    log P(choice | prompt) = sum_i log P(t_i | prompt, t_<i)

A hybrid decoder's linear-attention layers (Qwen3.5) keep one state per row, not per-token
K/V that a mask could select: for them each choice is a branch (``linear_attention.Branches``)
that starts from the row's state at the end of the prompt (the prefill's, ``AfterPrefill``),
replicated per choice, and runs its own tokens through the gated delta rule in a row of its
own; the full-attention layers read the shared K/V through the mask as above.

Shapes: B rows, R rows with a label set, M choices in all (rows, then choices, in order), N
continuation tokens per row (padded), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vlmbatch.engine.scoring import ChoiceIds
from vlmbatch.models.base import KV, Decoder
from vlmbatch.models.linear_attention import Branches

ToDevice = Callable[[list], torch.Tensor]  # a host list as a long tensor on the device


@dataclass
class AfterPrefill:
    """What a prefill leaves for what follows it (a continuation, a greedy decode): the
    batch's cached past (padded, or None) and its lengths, the new tokens' KV and lengths,
    each row's rope delta."""
    past: list[KV] | None
    past_lengths: torch.Tensor | None
    new_kv: list[KV]
    lengths: torch.Tensor
    deltas: list[int]
    mrope: bool  # the positions are M-RoPE's [3, ...]

    def rows(self, to_device: ToDevice, rows: list[int]) -> AfterPrefill:
        """The same for the subset ``rows`` (a copy)."""
        sel = to_device(rows)
        return AfterPrefill(
            None if self.past is None else [(k[sel], v[sel]) for k, v in self.past],
            None if self.past_lengths is None else self.past_lengths[sel],
            [(k[sel], v[sel]) for k, v in self.new_kv], self.lengths[sel],
            [self.deltas[j] for j in rows], self.mrope)

    def keys(self, to_device: ToDevice, llm: Decoder
             ) -> tuple[list[KV], torch.Tensor, torch.Tensor]:
        """Per layer (k, v) ``[B, K, P + T, d]`` (past then new, each padded: a copy; a
        linear-attention layer's entry is its state after the prompt, ``llm.join_cache``),
        which are real ``[B, P + T]``, and the position of the token after each prompt
        ``[B]`` (its length, plus its rope delta): what a decode or a continuation reads."""
        kv = self.new_kv if self.past is None else llm.join_cache(self.past, self.new_kv)
        f = llm.kinds.index("full")  # a full layer's K/V give the widths
        dev = self.lengths.device
        valid = torch.arange(self.new_kv[f][0].shape[2], device=dev)[None] < self.lengths[:, None]
        pos = self.lengths.clone()
        if self.past is not None and self.past_lengths is not None:
            seen = torch.arange(self.past[f][0].shape[2], device=dev)[None] \
                < self.past_lengths[:, None]
            valid = torch.cat([seen, valid], 1)
            pos += self.past_lengths
        if any(self.deltas):
            pos += to_device(self.deltas)
        return kv, valid, pos


def choice_logprobs(llm: Decoder, to_device: ToDevice, choices: list[ChoiceIds],
                    logits: torch.Tensor, after: AfterPrefill,
                    first_token: bool) -> torch.Tensor | None:
    """Every choice's log-likelihood ``[M]`` (``choices``: each of the B rows' label set, ()
    for none; rows, then choices, in order; None without any): its first token's from the
    prompt's ``logits [B, V]``, plus, unless ``first_token``, its later tokens' from one
    continuation (``_continue``, for the rows with a choice of several tokens)."""
    rows = [j for j, c in enumerate(choices) if c]
    if not rows:
        return None
    flat = [(k, ids) for k, j in enumerate(rows) for ids in choices[j]]
    lsm = torch.log_softmax(logits[to_device(rows)].float(), -1)  # [R, V]
    out = lsm[to_device([k for k, _ in flat]), to_device([x[0] for _, x in flat])]  # [M]
    bases = np.cumsum([0] + [len(choices[j]) for j in rows]).tolist()
    longer = [k for k, j in enumerate(rows) if any(len(x) > 1 for x in choices[j])]
    if first_token or not longer:
        return out
    return _continue(llm, to_device, [choices[rows[k]] for k in longer],
                     [bases[k] for k in longer], after.rows(to_device, [rows[k] for k in longer]),
                     out)


def _continue(llm: Decoder, to_device: ToDevice, choices: list[ChoiceIds], bases: list[int],
              after: AfterPrefill, first: torch.Tensor) -> torch.Tensor:
    """``first`` [M] plus each choice's tokens after its first (module docstring): one
    ``extend`` forward over a row per prompt. Row j's new token t predicts its choice's token
    t+1; ``bases[j]``: the index of row j's first choice in ``first``."""
    m = len(first)
    tok, tgt, seg, off = (to_device(x) for x in _segments(choices, bases, m))  # [R, N] each
    kv, valid, pos0 = after.keys(to_device, llm)  # per layer [R, K, S, d]; [R, S]; [R]
    pos = pos0[:, None] + off  # [R, N]: text after the prompt (+ its rope delta)
    if after.mrope:
        pos = pos.expand(3, *pos.shape)  # a text token: the same on all three axes
    same = (seg[:, :, None] == seg[:, None, :]) & (seg < m)[:, None, :]
    mask = same & (off[:, None, :] <= off[:, :, None])  # [R, N, N]: causal within a choice
    branches = _branches(choices, tok.shape[1], to_device) if "linear" in llm.kinds else None
    logits, _ = llm.extend(llm.embed_tokens(tok), pos, kv, valid, mask, branches)  # [R, N, V]
    lp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]  # [R, N]
    total = torch.cat([first, first.new_zeros(1)])  # slot m takes the padding
    return total.index_add(0, seg.flatten(), lp.flatten())[:-1]


def _segments(choices: list[ChoiceIds], bases: list[int], m: int
              ) -> tuple[list[list[int]], ...]:
    """The continuation's rows, right-padded to N: each choice's tokens but its last
    (``tok``), the token each predicts (``tgt``), the choice's index among all ``m`` choices
    (``seg``: ``bases[row]`` + its index in the row; ``m`` for padding) and the token's offset
    in its choice (``off``)."""
    rows: list[tuple[list[int], ...]] = []
    for row, base in zip(choices, bases):
        tok: list[int] = []
        tgt: list[int] = []
        seg: list[int] = []
        off: list[int] = []
        for c, ids in enumerate(row):
            tok += ids[:-1]
            tgt += ids[1:]
            seg += [base + c] * (len(ids) - 1)
            off += range(len(ids) - 1)
        rows.append((tok, tgt, seg, off))
    n = max(len(r[0]) for r in rows)
    pad = (0, 0, m, 0)
    return tuple([r[i] + [pad[i]] * (n - len(r[i])) for r in rows] for i in range(4))


def _branches(choices: list[ChoiceIds], n: int, to_device: ToDevice) -> Branches:
    """Each choice with tokens after its first as one branch (module docstring): its
    continuation tokens' flat positions ``r * n + t`` in the ``[R, n]`` rows ``_segments``
    lays out (padding: ``R * n``), the row whose state it continues."""
    rows: list[int] = []
    runs: list[list[int]] = []
    for r, row in enumerate(choices):
        at = r * n
        for ids in row:
            if len(ids) > 1:
                rows.append(r)
                runs.append(list(range(at, at + len(ids) - 1)))
                at += len(ids) - 1
    width = max(len(x) for x in runs)
    pad = len(choices) * n
    lens = to_device([len(x) for x in runs])  # [M]
    return Branches(to_device(rows), to_device([x + [pad] * (width - len(x)) for x in runs]),
                    torch.arange(width, device=lens.device)[None] < lens[:, None])
