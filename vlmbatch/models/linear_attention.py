"""Gated DeltaNet, Qwen3.5's linear-attention token mixer: a short causal convolution, then
the gated delta rule, a recurrent state per value head in place of per-token K/V.

Equations (transformers' ``Qwen3_5GatedDeltaNet``, whose weight names these are): for
hidden states ``h [B, T, D]``,

- ``in_proj_qkv(h)`` -> channels [q (Hk * dk) | k (Hk * dk) | v (Hv * dv)], C in all, through
  a depthwise causal ``conv1d`` of kernel K (no bias) and SiLU;
- ``beta = sigmoid(in_proj_b(h))``, ``g = -exp(A_log) * softplus(in_proj_a(h) + dt_bias)``
  (log decay, <= 0), both ``[B, T, Hv]``;
- q and k L2-normalised per head (eps 1e-6), q scaled by ``dk ** -0.5``; query/key head
  ``j // (Hv / Hk)`` serves value head j;
- per value head, state ``S [dk, dv]``: ``S = exp(g_t) S``; ``S += k_t (beta_t (v_t -
  S^T k_t))^T``; ``o_t = S^T q_t``;
- ``o`` RMS-normalised per head and gated, ``norm.weight * rms(o) * silu(in_proj_z(h))``,
  then ``out_proj``.

A layer's state is ``(conv, recurrent)``: the last K - 1 conv inputs ``[B, C, K - 1]`` (model
dtype) and ``S`` ``[B, Hv, dk, dv]`` (float32); zeros equal no history. Prefill runs the
rule in chunked form (``chunk_rule``: within a chunk a triangular solve, across chunks one
state update), decoding in recurrent form (``recurrent_rule``); both compute in float32.
The form is exact for any chunk size: a sequence shorter than ``CHUNK`` (a question after a
cached prefix, a label set's choice) takes one chunk of the next power of two >=
``MIN_CHUNK`` instead of being padded to ``CHUNK`` (``chunk_size``), which halves the
rule's work for a 29-token question.
Right padding: positions past a row's length get ``beta = 0`` and ``g = 0`` (the state passes
through them unchanged) and the conv state is read at the row's length, so the returned
state is each row's at its last real token, the same as without padding.

Two ways a call's tokens may sit (``Layout``), besides one sequence per row:

- ``at`` [B, P] (a prefill that snapshots the state at the end of an image's prefix, and of
  what its questions share after it, inside the same forward, ``docs/hybrid_cache.md``): the
  layer also returns each row's state after its first ``at[b, p]`` new tokens (0 <= at[b, p]
  <= its length). The chunked form reads it inside the chunk that holds position
  ``at[b, p] - 1`` (``_state_inside``: the chunk's starting state decayed to there, plus
  that chunk's writes up to there), so no chunk is added; the recurrent form keeps it as it
  passes. The returned state tensors then hold (1 + P) B rows: each row's state at its end,
  then each row's at ``at[:, 0]``, then at ``at[:, 1]``, ...
- ``Branches`` (a label set's choices side by side after one prompt, ``extend``): M branches,
  each a run of a row's new tokens that continues *that row's* state, not the tokens before
  it in the row. Each branch's tokens are gathered into a row of their own, the row's state
  replicated per branch, the rule run per branch (chunked or recurrent as their length
  says), and the outputs scattered back to their places; the returned state tensors hold
  one row per branch (its state at its end).

On CUDA in bf16/fp16 with flash-linear-attention (``fla``) installed, its
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` kernels run the rule; the
torch forms otherwise (``KERNELS`` forces one for a test). fla gives no state inside a
sequence, so with ``at`` it runs once more per column over the tokens before ``at`` (``beta
= g = 0`` after them) for that state: another pass of the rule, not of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.models.layers import RMSNorm, activation

State = tuple[torch.Tensor, torch.Tensor]  # (conv [B, C, K-1], recurrent [B, Hv, dk, dv])
CHUNK = 64  # positions per chunk of the chunked form (fla's and transformers' size)
MIN_CHUNK = 16  # a shorter sequence takes one chunk of the next power of two from here
KERNELS = "auto"  # "auto": fla where it can run; "torch": always the torch forms


@dataclass(frozen=True)
class Branches:
    """M side-by-side continuations of the rows' states (module docstring): branch m is the
    tokens of row ``rows[m]`` at flat positions ``index[m]`` (``b * N + t`` in the call's
    ``[B, N]``, in order; padding: ``B * N``, a slot past the end), real where ``valid``."""
    rows: torch.Tensor  # [M] long
    index: torch.Tensor  # [M, n] long
    valid: torch.Tensor  # [M, n] bool, right-padded


@dataclass(frozen=True)
class Layout:
    """How a call's new tokens sit in its rows (module docstring): ``valid`` [B, T] the real
    ones, right-padded (None: all); ``at`` [B, P] also return the states after that many;
    ``branches`` continuations side by side (then ``valid`` and ``at`` are not read)."""
    valid: torch.Tensor | None = None
    at: torch.Tensor | None = None
    branches: Branches | None = None


@dataclass(frozen=True)
class LinearSpec:
    """A Gated DeltaNet layer's sizes (transformers' ``linear_*`` config fields)."""
    conv_kernel: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ValueError(f"{self.value_heads} linear value heads do not share "
                             f"{self.key_heads} key heads")
        if min(self.conv_kernel, self.key_dim, self.value_dim) < 1:
            raise ValueError("linear conv kernel and head dims must be >= 1")

    @property
    def conv_dim(self) -> int:
        """C: the conv's channels, q, k and v together."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class GatedRMSNorm(RMSNorm):
    """``weight * rms_norm(x) * silu(gate)`` per value head (transformers'
    ``Qwen3_5RMSNormGated``: weight applied in the input dtype, the gate in float32)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention mixer (module docstring)."""

    def __init__(self, hidden: int, spec: LinearSpec, eps: float, act: str) -> None:
        super().__init__()
        self.ls = s = spec
        self.in_proj_qkv = nn.Linear(hidden, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, s.value_heads * s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, s.value_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, eps)
        self.out_proj = nn.Linear(s.value_heads * s.value_dim, hidden, bias=False)
        self.act = activation(act)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per row: the conv state (model dtype) and the recurrent state (float32)."""
        s = self.ls
        return [((s.conv_dim, s.conv_kernel - 1), self.conv1d.weight.dtype),
                ((s.value_heads, s.key_dim, s.value_dim), torch.float32)]

    def forward(self, h: torch.Tensor, state: State | None,
                layout: Layout | None = None) -> tuple[torch.Tensor, State]:
        # h: [B, T, D]; state: the layer's state before these tokens (None: zeros); layout:
        # which tokens are real, where to read a snapshot, branches (module docstring).
        # Returns the output [B, T, D] and the state after (rows: module docstring).
        b, t, _ = h.shape
        s = self.ls
        lay = layout or Layout()
        x = self.in_proj_qkv(h)  # [B, T, C]
        beta = torch.sigmoid(self.in_proj_b(h).float())  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(h).float()
                                                   + self.dt_bias.float())
        if lay.branches is None:
            o, new = self._rule(x, g, beta, state, lay.valid, lay.at)
        else:
            o, new = self._branched(x, g, beta, state, lay.branches)
        o = self.norm(o.to(h.dtype), self.in_proj_z(h).view(b, t, s.value_heads, s.value_dim))
        return self.out_proj(o.reshape(b, t, -1)), new

    def _rule(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: State | None,
              valid: torch.Tensor | None, at: torch.Tensor | None
              ) -> tuple[torch.Tensor, State]:
        """The conv and the delta rule over rows: x [B, T, C] (projected), g and beta
        [B, T, Hv] -> (o [B, T, Hv, dv] float32, the state after each row's real tokens,
        then with ``at`` [B, P] after its first at[b, p]: (1 + P) B rows)."""
        b, t, _ = x.shape
        s = self.ls
        x, conv = self._conv(x.transpose(1, 2), state, valid, at)  # [B, T, C]
        q, k, v = x.split([s.key_heads * s.key_dim] * 2 + [s.value_heads * s.value_dim], -1)
        if valid is not None:  # padding leaves the state as it is (module docstring)
            beta, g = beta * valid[..., None], g * valid[..., None]
        rec = None if state is None else state[1]
        o, rec = delta_rule(q.reshape(b, t, s.key_heads, s.key_dim),
                            k.reshape(b, t, s.key_heads, s.key_dim),
                            v.reshape(b, t, s.value_heads, s.value_dim), g, beta, rec, at)
        return o, (conv, rec)

    def _branched(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: State | None, br: Branches) -> tuple[torch.Tensor, State]:
        """``_rule`` per branch (module docstring): each branch's tokens gathered into a row
        ``[M, n, *]`` (the padding slot reads zeros), its row's state replicated, the
        outputs scattered back to ``[B, T, Hv, dv]`` (tokens in no branch: zeros)."""
        b, t, _ = x.shape

        def gather(y: torch.Tensor) -> torch.Tensor:  # [B, T, *] -> [M, n, *]
            flat = torch.cat([y.flatten(0, 1), y.new_zeros(1, *y.shape[2:])])
            return flat[br.index]

        start = None if state is None else (state[0][br.rows], state[1][br.rows])
        o, new = self._rule(gather(x), gather(g), gather(beta), start, br.valid, None)
        out = o.new_zeros(b * t + 1, *o.shape[2:])  # the last slot takes the padding
        out.index_copy_(0, br.index.flatten(), o.flatten(0, 1))
        return out[:-1].view(b, t, *o.shape[2:]), new

    def _conv(self, x: torch.Tensor, state: State | None, valid: torch.Tensor | None,
              at: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C, T] -> (causal conv + activation [B, T, C], conv state [B, C, K-1] at each
        row's last real token; with ``at`` [B, P], then per column [B, C, K-1] after its
        first at[b, p] tokens)."""
        b, c, t = x.shape
        keep = self.ls.conv_kernel - 1
        before = x.new_zeros(b, c, keep) if state is None else state[0].to(x.dtype)
        xs = torch.cat([before, x], dim=2)  # [B, C, K-1+T]
        out = self.act(F.conv1d(xs, self.conv1d.weight, groups=c)).transpose(1, 2)
        if valid is None and at is None:
            return out, xs[:, :, t:].contiguous()
        ends = [torch.full((b,), t, device=x.device) if valid is None else valid.sum(1)]
        if at is not None:
            ends += at.unbind(1)
        return out, torch.cat([_window(xs, e, keep) for e in ends])


def _window(xs: torch.Tensor, ends: torch.Tensor, keep: int) -> torch.Tensor:
    """xs [B, C, K-1+T] (the state's K-1 inputs, then the tokens') -> the K-1 inputs before
    token ends[b] of each row ``[B, C, K-1]``: the conv state after ends[b] tokens."""
    b, c, _ = xs.shape
    at = (ends[:, None] + torch.arange(keep, device=xs.device))[:, None, :]  # [B, 1, K-1]
    return xs.gather(2, at.expand(b, c, keep))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor | None, at: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on raw q, k [B, T, Hk, dk], v [B, T, Hv, dv], g and beta
    [B, T, Hv] (float32), from ``state`` [B, Hv, dk, dv] (None: zeros): (o [B, T, Hv, dv]
    float32, final state [B, Hv, dk, dv] float32; with ``at`` [B, P], then each row's state
    after its first at[b, p] tokens, column by column: [(1 + P) B, Hv, dk, dv]). q/k are
    L2-normalised here, q scaled."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:  # query/key head j // rep serves value head j
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    kernel = _fla_kernels(q)
    if kernel is not None:
        o, final = _fla(kernel, q, k, v, g, beta, state)
        if at is None:
            return o, final
        pos = torch.arange(q.shape[1], device=q.device)[None]
        snaps = []
        for col in at.unbind(1):  # module docstring: a pass of the rule per column
            before = (pos < col[:, None])[..., None]
            snaps.append(_fla(kernel, q, k, v, g * before, beta * before, state)[1])
        return o, torch.cat([final, *snaps])
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    rule = recurrent_rule if q.shape[1] <= 2 else chunk_rule  # decoding: token by token
    qh, kh, vh, gh, bh = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # heads first
    size = {} if rule is recurrent_rule else {"chunk": chunk_size(q.shape[1])}
    o, final = rule(qh, kh, vh, gh, bh, state.float(), at=at, **size)
    return o.transpose(1, 2), final


def chunk_size(t: int) -> int:
    """The chunked form's chunk for T positions (module docstring): ``CHUNK``, or for a
    shorter sequence the next power of two from ``MIN_CHUNK``."""
    return CHUNK if t >= CHUNK else max(MIN_CHUNK, 1 << (t - 1).bit_length())


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor, at: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: q, k [B, H, T, dk] (normalised, q scaled), v [B, H, T, dv], g, beta
    [B, H, T], state [B, H, dk, dv] -> (o [B, H, T, dv], final state; with ``at`` [B, P],
    then the states after at[b, p] tokens: (1 + P) B rows)."""
    out = []
    cols = [] if at is None else list(at.unbind(1))  # each [B]
    snaps = [state] * len(cols)
    for i in range(q.shape[2]):
        state = state * g[:, :, i, None, None].exp()
        k_i = k[:, :, i]  # [B, H, dk]
        delta = (v[:, :, i] - torch.einsum("bhkv,bhk->bhv", state, k_i)) * beta[:, :, i, None]
        state = state + k_i[..., None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, i]))
        for p, col in enumerate(cols):
            snaps[p] = torch.where((col == i + 1)[:, None, None, None], state, snaps[p])
    return torch.stack(out, 2), torch.cat([state, *snaps]) if snaps else state


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK,
               at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_rule`` in chunks of ``chunk`` positions (the DeltaNet paper's WY form):
    inside a chunk, with cumulative log decay G and decays ``D[i, j] = exp(G_i - G_j)``
    (j <= i), the chunk's state reads and writes are one triangular solve of ``I +
    strict_lower(beta K K^T * D)``; across chunks one update of the state. Shapes as
    ``recurrent_rule``; T is padded to a multiple of ``chunk`` with beta = g = 0. ``at``
    [B, P]: the states after at[b, p] tokens too, each read inside its chunk
    (``_state_inside``)."""
    b, h, t, dk = k.shape
    pad = -t % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    cum = g.reshape(b, h, n, chunk).cumsum(-1)  # G [B, H, n, c]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta.reshape(b, h, n, chunk, 1)
    system = torch.eye(chunk, device=q.device) + ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    # one solve for both right-hand sides: u (new values) and w (decayed keys), [.., c, dv | dk]
    u, w = torch.linalg.solve_triangular(
        system, torch.cat([v * beta.reshape(b, h, n, chunk, 1), kb * cum[..., None].exp()], -1),
        upper=False, unitriangular=True).split([v.shape[-1], dk], -1)
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, c, c], causal within the chunk
    q_in = q * cum[..., None].exp()  # reads of the state at the chunk's start
    last = cum[..., -1:]  # [B, H, n, 1]
    k_out = k * (last - cum)[..., None].exp()  # writes, decayed to the chunk's end
    cols = [] if at is None else list(at.unbind(1))  # each [B]
    which = [(col - 1).clamp(min=0) // chunk for col in cols]  # each at's chunk
    firsts = [state] * len(cols)  # the state at the start of each at's chunk
    out = []
    for i in range(n):
        for p, ch in enumerate(which if i else []):
            firsts[p] = torch.where((ch == i)[:, None, None, None], state, firsts[p])
        v_new = u[:, :, i] - w[:, :, i] @ state  # [B, H, c, dv]
        out.append(q_in[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * last[:, :, i, :, None].exp() + k_out[:, :, i].transpose(-1, -2) @ v_new
    o = torch.cat(out, 2)[:, :, :t]
    if not cols:
        return o, state
    return o, torch.cat([state, *(_state_inside(f, ch, col, u, w, k, cum)
                                  for f, ch, col in zip(firsts, which, cols))])


def _state_inside(first: torch.Tensor, which: torch.Tensor, at: torch.Tensor, u: torch.Tensor,
                  w: torch.Tensor, k: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """The state after at[b] tokens, inside chunk ``which[b]`` (``chunk_rule``'s tensors,
    ``[B, H, n, c, *]``; ``first`` [B, H, dk, dv] the state at that chunk's start): the start
    decayed to position o = at - 1 within the chunk, plus the chunk's writes up to o, each
    decayed from its position to o:

        S_o = exp(G_o) S_first + sum_{j <= o} exp(G_o - G_j) k_j (u_j - w_j S_first)^T

    (the chunk's end-of-chunk update with o in place of its last position). at[b] = 0:
    the state before any token."""
    b, h, _, c, _ = u.shape
    o = ((at - 1).clamp(min=0) % c)[:, None, None]  # [B, 1, 1]
    pick = which[:, None, None, None, None]

    def chunk_of(x: torch.Tensor) -> torch.Tensor:  # [B, H, n, c, d] -> [B, H, c, d]
        return x.gather(2, pick.expand(b, h, 1, c, x.shape[-1]))[:, :, 0]

    g = cum.gather(2, which[:, None, None, None].expand(b, h, 1, c))[:, :, 0]  # [B, H, c]
    g_o = g.gather(2, o.expand(b, h, 1))  # [B, H, 1]
    upto = torch.arange(c, device=u.device)[None, None] <= o  # [B, 1, c]
    weight = (g_o - g).masked_fill(~upto, float("-inf")).exp()  # [B, H, c]
    v_new = chunk_of(u) - chunk_of(w) @ first  # [B, H, c, dv]
    writes = (chunk_of(k) * weight[..., None]).transpose(-1, -2) @ v_new  # [B, H, dk, dv]
    snap = first * g_o[..., None].exp() + writes
    return torch.where((at == 0)[:, None, None, None], first, snap)


def _fla_kernels(q: torch.Tensor) -> Any | None:
    """flash-linear-attention's gated-delta-rule module where it can run: a CUDA tensor in
    bf16/fp16 (its kernels refuse float32), ``fla`` installed, ``KERNELS`` not "torch"."""
    if KERNELS == "torch" or not q.is_cuda or q.dtype == torch.float32:
        return None
    try:  # optional dependency: flash-linear-attention (triton kernels, CUDA only)
        from fla.ops import gated_delta_rule
    except ImportError:
        return None
    return gated_delta_rule


def _fla(kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule`` through fla (inputs [B, T, H, *], heads already repeated; fla
    normalises q and k itself and scales q by dk ** -0.5 by default)."""
    rule = (kernels.fused_recurrent_gated_delta_rule if q.shape[1] <= 2
            else kernels.chunk_gated_delta_rule)
    o, final = rule(q, k, v.to(q.dtype), g.float(), beta.to(q.dtype),
                    initial_state=None if state is None else state.float(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o.float(), final.float()
