"""A Gated DeltaNet layer's two ways of reading a call's tokens besides one sequence per row
(``models/linear_attention.py``): the state at ``at`` taken inside the forward (a prefix's
snapshot), and ``Branches`` (a label set's choices side by side, each from its row's state).

Each is checked against the plain form run on exactly the tokens it stands for: the rule or
the layer on the first ``at`` tokens alone; each branch as its own sequence from its row's
state. Random float32 inputs and a random layer (slow decays, so a lost or wrong state moves
the outputs far above the tolerance, 1e-5); controls show the comparison can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.models.test_qwen3_5 import rule_inputs
from vlmbatch.models.linear_attention import (
    Branches,
    GatedDeltaNet,
    Layout,
    LinearSpec,
    chunk_rule,
    delta_rule,
    recurrent_rule,
)

TOL = 1e-5


@pytest.mark.parametrize("t,chunk", [(2, 16), (15, 16), (16, 16), (50, 16), (130, 64)])
def test_state_at_equals_the_rule_cut_there(t: int, chunk: int) -> None:
    """chunk_rule and recurrent_rule with ``at`` (two columns): the extra rows = the
    recurrent rule run on the first at[b, p] tokens only (at = 1, a chunk's last token, one
    past it, inside, the end, 0: the initial state); outputs and end states as without."""
    b = 6
    args = rule_inputs(b, 3, t, 8, 12, seed=t)
    first = [1, min(chunk, t), min(chunk + 1, t), max(1, t // 2 + 3) if t > 3 else 1, t, 0]
    at = torch.tensor([first, first[::-1]]).T.clamp(max=t)  # [B, 2]
    for rule, kw in ((chunk_rule, {"chunk": chunk}), (recurrent_rule, {})):
        o, states = rule(*args, at=at, **kw)
        o0, end = rule(*args, **kw)
        assert states.shape[0] == 3 * b and torch.equal(o, o0) and torch.equal(states[:b], end)
        for (p, j), n in np.ndenumerate(at.T.numpy()):
            want = args[5][j]  # at 0: the initial state
            if n:
                cut = [x[j:j + 1, :, :n] for x in args[:5]]
                want = recurrent_rule(*cut, args[5][j:j + 1])[1][0]
            assert (states[(1 + p) * b + j] - want).abs().max() <= TOL, (rule.__name__, p, j)
    # a control: the state one token later differs
    cut = [x[:1, :, : int(at[0, 0]) + 1] for x in args[:5]]
    _, later = recurrent_rule(*cut, args[5][:1])
    _, states = chunk_rule(*args, at=at, chunk=chunk)
    assert (states[b] - later[0]).abs().max() > 1e-3


def layer(seed: int = 0) -> GatedDeltaNet:
    """A small Gated DeltaNet (2 key heads serving 4 value heads, dk 8, dv 12, kernel 4),
    every parameter random, decays slow."""
    torch.manual_seed(seed)
    m = GatedDeltaNet(32, LinearSpec(4, 2, 4, 8, 12), 1e-6, "silu").eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name == "A_log":
                p.uniform_(math.log(0.005), math.log(0.1))
            elif p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return m


def random_state(m: GatedDeltaNet, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    (conv, _), (rec, _) = m.state_shapes()
    return torch.randn(b, *conv, generator=g), torch.randn(b, *rec, generator=g) * 0.3


@torch.no_grad()
def test_layer_state_at_equals_the_layer_on_the_prefix() -> None:
    """``Layout(valid, at)``: rows right-padded to different lengths; the returned conv and
    recurrent states' extra rows = the layer run on each row's first at[b] tokens alone
    (chunked: 70 and 90 tokens); the outputs and end states as without ``at``."""
    m = layer()
    lengths, at = [90, 70, 5], [64, 1, 5]  # one column
    h = torch.randn(3, 90, 32)
    valid = torch.arange(90)[None] < torch.tensor(lengths)[:, None]
    past = random_state(m, 3, seed=1)
    out, (conv, rec) = m(h, past, Layout(valid, torch.tensor(at)[:, None]))
    plain, (conv0, rec0) = m(h, past, Layout(valid))
    assert torch.equal(out, plain) and torch.equal(conv[:3], conv0)
    assert (rec[:3] - rec0).abs().max() <= TOL
    for j, a in enumerate(at):
        _, (c, r) = m(h[j:j + 1, :a], (past[0][j:j + 1], past[1][j:j + 1]))
        assert (conv[3 + j] - c[0]).abs().max() <= TOL and (rec[3 + j] - r[0]).abs().max() <= TOL


def branches(lengths: list[list[int]], n: int) -> tuple[Branches, list[tuple[int, list[int]]]]:
    """Per row, branches of these lengths laid side by side from position 0 in a row of
    ``n`` tokens: the record, and each branch's (row, positions)."""
    rows, runs = [], []
    for r, row in enumerate(lengths):
        at = 0
        for k in row:
            rows.append(r)
            runs.append(list(range(at, at + k)))
            at += k
    width = max(len(x) for x in runs)
    pad = len(lengths) * n
    index = torch.tensor([[r * n + t for t in x] + [pad] * (width - len(x))
                          for r, x in zip(rows, runs)])
    valid = torch.tensor([[True] * len(x) + [False] * (width - len(x)) for x in runs])
    return Branches(torch.tensor(rows), index, valid), list(zip(rows, runs))


@pytest.mark.parametrize("lengths", [[[1, 2, 1], [2]], [[3, 70, 1], [5, 2]]],
                         ids=["recurrent", "chunked"])
@torch.no_grad()
def test_branches_equal_each_branch_alone(lengths: list[list[int]]) -> None:
    """Each branch's outputs and end state = the layer run on that branch's tokens alone as
    one sequence from its row's state (the rule recurrent when no branch has more than two
    tokens, chunked otherwise); positions in no branch give zeros. Controls: a branch run
    from another row's state, or after its row's earlier branches, differs."""
    m = layer(1)
    n = max(sum(x) for x in lengths) + 2  # padding after the last branch of each row
    h = torch.randn(len(lengths), n, 32)
    past = random_state(m, len(lengths), seed=2)
    br, runs = branches(lengths, n)
    out, (conv, rec) = m(h, past, Layout(branches=br))
    assert conv.shape[0] == rec.shape[0] == len(runs)
    used = torch.zeros(len(lengths), n, dtype=torch.bool)
    for k, (r, pos) in enumerate(runs):
        alone, (c, s) = m(h[r:r + 1, pos], (past[0][r:r + 1], past[1][r:r + 1]))
        assert (out[r, pos] - alone[0]).abs().max() <= TOL
        assert (conv[k] - c[0]).abs().max() <= TOL and (rec[k] - s[0]).abs().max() <= TOL
        used[r, pos] = True
        other = (r + 1) % len(lengths)
        wrong, _ = m(h[r:r + 1, pos], (past[0][other:other + 1], past[1][other:other + 1]))
        assert (wrong[0] - alone[0]).abs().max() > 1e-3
    assert not out[~used].any()
    r, pos = runs[1]  # the row's second branch read after its first: another history
    chained, _ = m(h[r:r + 1, : pos[-1] + 1], (past[0][r:r + 1], past[1][r:r + 1]))
    alone, _ = m(h[r:r + 1, pos], (past[0][r:r + 1], past[1][r:r + 1]))
    assert (chained[0, pos] - alone[0]).abs().max() > 1e-3


def test_delta_rule_returns_the_state_at_too() -> None:
    """``delta_rule``'s wrapper (heads grouped, q/k normalised inside) passes ``at`` on: its
    extra rows = the rule on the tokens before ``at``."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 40, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 40, 4, 12, generator=g)
    decay, beta = -0.2 * torch.rand(2, 40, 4, generator=g), torch.rand(2, 40, 4, generator=g)
    o, states = delta_rule(q, k, v, decay, beta, None, torch.tensor([[7], [40]]))
    for j, a in enumerate((7, 40)):
        _, want = delta_rule(q[j:j + 1, :a], k[j:j + 1, :a], v[j:j + 1, :a], decay[j:j + 1, :a],
                             beta[j:j + 1, :a], None)
        assert (states[2 + j] - want[0]).abs().max() <= TOL


@pytest.mark.parametrize("t", [3, 16, 17, 29, 32])
def test_a_short_sequence_takes_a_smaller_chunk(t: int) -> None:
    """Shorter than ``CHUNK``, the chunked form runs one chunk of the next power of two
    (``chunk_size``), not 64: its outputs and state still = the recurrent form's."""
    from vlmbatch.models.linear_attention import CHUNK, chunk_size

    assert chunk_size(t) < CHUNK and chunk_size(t) >= t
    args = rule_inputs(2, 3, t, 8, 12, seed=t)
    o1, s1 = recurrent_rule(*args)
    o2, s2 = chunk_rule(*args, chunk=chunk_size(t))
    assert (o1 - o2).abs().max() <= TOL and (s1 - s2).abs().max() <= TOL
