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
Right padding: positions past a row's length get ``beta = 0`` and ``g = 0`` (the state passes
through them unchanged) and the conv state is read at the row's length, so the returned
state is each row's at its last real token, the same as without padding.

On CUDA in bf16/fp16 with flash-linear-attention (``fla``) installed, its
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` kernels run the rule; the
torch forms otherwise (``KERNELS`` forces one for a test).
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
KERNELS = "auto"  # "auto": fla where it can run; "torch": always the torch forms


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
                valid: torch.Tensor | None) -> tuple[torch.Tensor, State]:
        # h: [B, T, D]; state: the layer's state before these tokens (None: zeros);
        # valid: [B, T] bool, right-padded (None: all real). Returns output, state after.
        b, t, _ = h.shape
        s = self.ls
        x, conv = self._conv(self.in_proj_qkv(h).transpose(1, 2), state, valid)  # [B, T, C]
        q, k, v = x.split([s.key_heads * s.key_dim] * 2 + [s.value_heads * s.value_dim], -1)
        beta = torch.sigmoid(self.in_proj_b(h).float())  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(h).float()
                                                   + self.dt_bias.float())
        if valid is not None:  # padding leaves the state as it is (module docstring)
            beta, g = beta * valid[..., None], g * valid[..., None]
        rec = None if state is None else state[1]
        o, rec = delta_rule(q.reshape(b, t, s.key_heads, s.key_dim),
                            k.reshape(b, t, s.key_heads, s.key_dim),
                            v.reshape(b, t, s.value_heads, s.value_dim), g, beta, rec)
        o = self.norm(o.to(h.dtype), self.in_proj_z(h).view(b, t, s.value_heads, s.value_dim))
        return self.out_proj(o.reshape(b, t, -1)), (conv, rec)

    def _conv(self, x: torch.Tensor, state: State | None,
              valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C, T] -> (causal conv + activation [B, T, C], conv state [B, C, K-1] at each
        row's last real token)."""
        b, c, t = x.shape
        keep = self.ls.conv_kernel - 1
        before = x.new_zeros(b, c, keep) if state is None else state[0].to(x.dtype)
        xs = torch.cat([before, x], dim=2)  # [B, C, K-1+T]
        out = self.act(F.conv1d(xs, self.conv1d.weight, groups=c)).transpose(1, 2)
        if valid is None:
            return out, xs[:, :, t:].contiguous()
        ends = valid.sum(1)  # [B]: real tokens
        at = (ends[:, None] + torch.arange(keep, device=x.device))[:, None, :]  # [B, 1, K-1]
        return out, xs.gather(2, at.expand(b, c, keep))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on raw q, k [B, T, Hk, dk], v [B, T, Hv, dv], g and beta
    [B, T, Hv] (float32), from ``state`` [B, Hv, dk, dv] (None: zeros): (o [B, T, Hv, dv]
    float32, final state [B, Hv, dk, dv] float32). q/k are L2-normalised here, q scaled."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:  # query/key head j // rep serves value head j
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    kernel = _fla_kernels(q)
    if kernel is not None:
        return _fla(kernel, q, k, v, g, beta, state)
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    rule = recurrent_rule if q.shape[1] <= 2 else chunk_rule  # decoding: token by token
    qh, kh, vh, gh, bh = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # heads first
    o, final = rule(qh, kh, vh, gh, bh, state.float())
    return o.transpose(1, 2), final


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: q, k [B, H, T, dk] (normalised, q scaled), v [B, H, T, dv], g, beta
    [B, H, T], state [B, H, dk, dv] -> (o [B, H, T, dv], final state)."""
    out = []
    for i in range(q.shape[2]):
        state = state * g[:, :, i, None, None].exp()
        k_i = k[:, :, i]  # [B, H, dk]
        delta = (v[:, :, i] - torch.einsum("bhkv,bhk->bhv", state, k_i)) * beta[:, :, i, None]
        state = state + k_i[..., None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, i]))
    return torch.stack(out, 2), state


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor,
               chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_rule`` in chunks of ``chunk`` positions (the DeltaNet paper's WY form):
    inside a chunk, with cumulative log decay G and decays ``D[i, j] = exp(G_i - G_j)``
    (j <= i), the chunk's state reads and writes are one triangular solve of ``I +
    strict_lower(beta K K^T * D)``; across chunks one update of the state. Shapes as
    ``recurrent_rule``; T is padded to a multiple of ``chunk`` with beta = g = 0."""
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
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # [B, H, c, dv]
        out.append(q_in[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * last[:, :, i, :, None].exp() + k_out[:, :, i].transpose(-1, -2) @ v_new
    return torch.cat(out, 2)[:, :, :t], state


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
