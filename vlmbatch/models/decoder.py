"""The text decoder of every family: one module, its variants options of one ``TextSpec``.

InternVL's Qwen2 decoder and the Qwen2-VL / Qwen2.5-VL / Qwen3-VL decoders are this class
with different specs (each family's config reader builds it: ``internvl/family.py``,
``qwen_vl/spec.py``). Weights and maths follow transformers' ``Qwen2Model`` /
``Qwen2VLTextModel`` / ``Qwen3VLTextModel``: RMSNorm (``F.rms_norm``), rotary embedding with
``rotate_half`` as one roll (``layers.py``), grouped-query attention on SDPA, SwiGLU MLP.
The options:

- ``rope``: ``"1d"`` (position = sequence index), ``"mrope-sectioned"`` (Qwen2/2.5-VL: the
  head's rotary frequency pairs split ``mrope_section = (t, h, w)``, each section turned by
  that axis' position) or ``"mrope-interleaved"`` (Qwen3-VL: pair j follows h if j % 3 == 1
  and j < 3 * section_h, w if j % 3 == 2 and j < 3 * section_w, else t);
- ``rotary_dim``: rotary on the first ``rotary_dim`` channels of each head only, the rest
  passed through (transformers' ``partial_rotary_factor``; None: the whole head);
- ``qk_norm`` (RMSNorm of q and k over the head dim, before rotary: Qwen3), ``qkv_bias``,
  ``o_bias``, ``act`` (the MLP's gate activation), ``head_dim`` (explicit: Qwen3's is not
  hidden / heads), GQA (``kv_heads`` < ``heads``: SDPA ``enable_gqa``, K/V never repeated);
- ``centered_norm``: every RMSNorm of the stack (layer norms, q/k norms, the final norm) in
  Qwen3.5's zero-centred form, ``(1 + weight) * x / rms(x)`` (``layers.CenteredRMSNorm``);
- ``attn_gate`` (Qwen3.5's gated attention, ``GatedAttention``): ``q_proj`` gives each
  query head its query and an output gate of the same width, interleaved per head
  (``[B, T, H, 2d]`` split in halves); the attention output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``;
- DeepStack (Qwen3-VL): extra image features added at the image positions after each of the
  first ``len(features)`` layers, for any spec that is given them;
- ``layer_kinds``: each layer's token mixer, ``"full"`` (attention, per-token K/V) or
  ``"linear"`` (Qwen3.5's Gated DeltaNet, ``models/linear_attention.py``, sized by
  ``linear``): its entry of ``past`` / the returned list is its state ``(conv [B, C, K-1],
  recurrent [B, Hv, dk, dv])`` before / after the call instead of k, v, a missing past
  meaning zeros; ``join_cache`` joins a cache with a step's output per kind (K/V appended, a
  state replaced). Positions and the attention mask concern the full layers only; a linear
  layer reads how the new tokens sit in their rows instead (``linear_attention.Layout``:
  which are real; ``prefill``'s ``state_at``, state snapshots inside the forward, which
  add B rows per snapshot column to its returned state; ``extend``'s ``branches``,
  continuations side by side, each from its row's state, whose returned state has a row
  per branch);
- ``qkv_layout``: ``"separate"`` (``q_proj``, ``k_proj``, ``v_proj``) or ``"grouped"``
  (InternLM2's one fused ``wqkv``: per key/value head its query heads, then its key, then
  its value; ``GroupedQKVAttention``); ``Attention.qkv`` is the one method that builds
  q, k, v (``Attention.project`` adds the output gate, ``GatedAttention``'s own). A grouped
  layout with ``attn_gate`` is refused: no checkpoint has one, and ``wqkv`` holds no gate;
- ``rope_scaling`` (1-D rotary): ``"linear"`` (positions / ``rope_factor``) or
  ``"dynamic"`` NTK (InternLM2's and transformers' Llama ``dynamic``: a row longer than
  ``max_positions`` gets a larger base). Which length: each row's own, after the tokens
  of the call (prefill: cached + new; decode: position + 1; ``extend``: its largest new
  position + 1, so a label set's choices side by side all take the base of the row's
  longest). For one prompt prefilled whole this is the published model's ``kv_seq_len``;
  the published module also keeps the largest table it has built and reuses it for later,
  shorter prompts, a history we do not copy (one answer per prompt, whatever ran before).
  Keys of a cached prefix keep the base of the length they were computed at, as the
  published decode keeps its past keys; a prompt within ``max_positions`` (32,768 for
  InternLM2-chat, 10x the longest image prompt) is never scaled, so none of this moves its
  answer.

Decided once (the two former decoders differed): ``past`` given without ``past_lengths``
means every cached position is real (and 1-D positions continue after them); checkpoint
weights under ``language_model.`` that the spec does not expect are refused with their
names, except the known-harmless ones (``HARMLESS``: a saved ``rotary_emb.inv_freq``
buffer, which older transformers wrote and which is recomputed from ``rope_theta``); a tied
model's saved ``lm_head.weight`` is ignored, as transformers ignores it.

Parameter names are transformers' without the family's prefix (``layers.0.self_attn.
q_proj.weight``, ``layers.0.mlp.gate_proj.weight``; the grouped layout's fused projection
``layers.0.self_attn.wqkv.weight``), so ``ModelFamily.llm_param`` /
``llm_key`` map every family the same way (``base.weight_key``).

Seams that later model families filled (each done now):

- Qwen3 text under InternVL (InternVL3.5): a spec with ``qk_norm=True`` and ``qkv_bias =
  o_bias = attention_bias``, as the Qwen-VL reader builds Qwen3-VL's.
- Qwen3.5: ``layer_kinds`` with ``"linear"`` layers (``LAYERS`` maps a kind to its
  module), gated full attention (``GatedAttention``: its ``project`` is the one place q, k,
  v and the gate are made; ``Attention.project`` calls ``qkv``), partial rotary
  (``rotary_dim``), zero-centred norms.
- InternLM2: the grouped ``wqkv`` (``qkv_layout``, ``QKV_LAYOUTS``; its weight names
  ``wqkv``, ``wo``, ``w1/w2/w3`` map in the family's ``normalise_key``) and rope scaling
  (``TextDecoder.rotary`` is the one place the tables are made).

Shapes: B rows, T new tokens (right-padded), P cached tokens, D hidden, V vocabulary, H query
heads, K key/value heads, d head dim, r rotary dim. K/V are returned with rotary applied, so
a cached prefix is reusable as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.models.base import KV, Decoder, DeepStack, weight_key
from vlmbatch.models.layers import (
    CenteredRMSNorm,
    FusedRMSNorm,
    RMSNorm,
    activation,
    fuse_into,
    inverse_frequencies,
    rope,
    rope_tables,
    rotary,
    scaled_inverse_frequencies,
)
from vlmbatch.models.linear_attention import Branches, GatedDeltaNet, Layout, LinearSpec

ROPE_KINDS = ("1d", "mrope-sectioned", "mrope-interleaved")
ROPE_SCALINGS = ("none", "linear", "dynamic")  # 1-D rotary only (module docstring)
HARMLESS = ("rotary_emb.inv_freq",)  # name endings of checkpoint weights that are dropped

# Repeat K/V per query head instead of SDPA's ``enable_gqa``? No, on both devices, measured
# with ``bench/attention.py`` at Qwen2-0.5B's layout:
# - CPU: ``enable_gqa`` level for a long prefill, faster for short prompts after a cached
#   prefix and at decode (the figures: docs/engine.md);
# - CUDA (H200, bf16, bench/gpu_check.sh, 2026-11-30): ``enable_gqa`` takes the math kernel
#   (flash takes no mask, memory-efficient no GQA) and expanded K/V the memory-efficient one,
#   yet ``enable_gqa`` is still faster in each case measured (docs/figures.md#gpu-gqa),
#   because the ``repeat_interleave`` copy costs more than the kernel saves at these sizes.
# Kept as a switch so that tests check both forms agree.
EXPAND_KV = False
# queries per attention call in a long prefill: the math kernels (the CPU's with a mask, CUDA's
# with enable_gqa) materialise [B, H, T, P + T] scores, quadratic in the prompt; cut into
# slices of this many queries, a prompt of S tokens holds [B, H, QUERY_CHUNK, S] at a time
# (exact: each query's softmax is its own row). Prompts up to this long: one call, as before.
QUERY_CHUNK = 1024


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              gqa: bool) -> torch.Tensor:
    """SDPA of q [B, H, T, d] over k, v [B, K, S, d] under mask [B, 1, T, S], QUERY_CHUNK
    queries at a time."""
    t = q.shape[2]
    if t <= QUERY_CHUNK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return torch.cat([F.scaled_dot_product_attention(
        q[:, :, i:i + QUERY_CHUNK], k, v, attn_mask=mask[:, :, i:i + QUERY_CHUNK],
        enable_gqa=gqa) for i in range(0, t, QUERY_CHUNK)], 2)


@dataclass(frozen=True)
class TextSpec:
    """A decoder's sizes and variants (module docstring); ValueError on construction for one
    the decoder cannot build (the families' config readers turn it into their error)."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    tie_embeddings: bool
    rope: str = "1d"  # one of ROPE_KINDS
    mrope_section: tuple[int, ...] = ()  # M-RoPE: rotary pairs given to the t, h, w axes
    rotary_dim: int | None = None  # rotary on the first rotary_dim channels; None: all
    qk_norm: bool = False
    qkv_bias: bool = True
    o_bias: bool = False
    act: str = "silu"
    centered_norm: bool = False  # Qwen3.5: RMSNorm weights stored as offsets from 1
    attn_gate: bool = False  # Qwen3.5: q_proj also gives a sigmoid output gate per head
    layer_kinds: tuple[str, ...] = ()  # per layer, one of LAYERS; (): every layer "full"
    linear: LinearSpec | None = None  # the "linear" layers' sizes
    qkv_layout: str = "separate"  # one of QKV_LAYOUTS (module docstring)
    rope_scaling: str = "none"  # one of ROPE_SCALINGS
    rope_factor: float = 1.0  # linear / dynamic scaling factor (>= 1)
    max_positions: int = 0  # dynamic: the trained length past which the base grows

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads do not share {self.kv_heads} kv heads")
        if self.rope not in ROPE_KINDS:
            raise ValueError(f"rope {self.rope!r} not one of {ROPE_KINDS}")
        r = self.rope_dim
        if r % 2 or not 0 < r <= self.head_dim:
            raise ValueError(f"rotary dim {r} must be even and in (0, head_dim {self.head_dim}]")
        if (self.rope != "1d") != bool(self.mrope_section):
            raise ValueError(f"mrope_section {self.mrope_section} is for M-RoPE only, and "
                             f"M-RoPE needs one (rope {self.rope!r})")
        if self.mrope_section and (len(self.mrope_section) != 3
                                   or sum(self.mrope_section) != r // 2):
            raise ValueError(f"mrope_section {self.mrope_section} must be 3 numbers summing "
                             f"to the rotary pairs, {r // 2}")
        if self.layer_kinds and len(self.layer_kinds) != self.layers:
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {self.layers} layers")
        if bad := sorted(set(self.layer_kinds) - set(LAYERS)):
            raise ValueError(f"layer kinds {bad} are not implemented (only {sorted(LAYERS)})")
        if ("linear" in self.layer_kinds) != (self.linear is not None):
            raise ValueError("linear-attention layers need their sizes (linear), and only "
                             "they take them")
        if self.rope_scaling not in ROPE_SCALINGS or (self.rope_scaling != "none"
                                                      and self.rope != "1d"):
            raise ValueError(f"rope scaling {self.rope_scaling!r} must be one of "
                             f"{ROPE_SCALINGS}, and scaled rotary is for 1-D rope only")
        if self.rope_scaling != "none" and not self.rope_factor >= 1:
            raise ValueError(f"rope scaling factor {self.rope_factor} must be >= 1")
        if self.rope_scaling == "dynamic" and self.max_positions < 1:
            raise ValueError("dynamic rope scaling needs max_positions (the trained length)")
        if self.qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"qkv layout {self.qkv_layout!r} not one of {sorted(QKV_LAYOUTS)}")
        if self.attn_gate and self.qkv_layout != "separate":
            raise ValueError(f"gated attention needs the separate q/k/v layout (q_proj gives "
                             f"the gate), not {self.qkv_layout!r}")
        activation(self.act)  # ValueError naming the supported ones

    @property
    def rope_dim(self) -> int:
        """r: the channels of each head that rotary turns (the first r)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind."""
        return self.layer_kinds or ("full",) * self.layers


def mrope_axes(spec: TextSpec) -> list[int]:
    """Which position axis (0 = t, 1 = h, 2 = w) turns each of the r/2 frequency pairs."""
    t, h, w = spec.mrope_section
    if spec.rope == "mrope-sectioned":
        return [0] * t + [1] * h + [2] * w
    return [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
            for j in range(t + h + w)]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first r channels of ``x [..., d]`` (cos/sin ``[..., r]``), the rest as
    they are; r = d is one ``rope`` call (the fast path)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return rope(x, cos, sin)
    return torch.cat([rope(x[..., :r], cos, sin), x[..., r:]], -1)


def make_norm(s: TextSpec, dim: int) -> RMSNorm:
    """The spec's RMSNorm over ``dim`` channels (module docstring: ``centered_norm``)."""
    return CenteredRMSNorm(dim, s.eps) if s.centered_norm else FusedRMSNorm(dim, s.eps)


class Attention(nn.Module):
    q_width = 1  # q_proj's output per query head channel (GatedAttention: query and gate)
    fused = False  # q_proj, k_proj, v_proj as one ``qkv_proj`` (``fuse_projections``)
    qkv_proj: nn.Module  # once fused

    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.s = s
        self.projections(s)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = make_norm(s, s.head_dim)
            self.k_norm = make_norm(s, s.head_dim)
        # q and k turned by one rotary call (``rotated``): the plain fused layout only
        self.joint = not s.qk_norm and self.q_width == 1 and s.qkv_layout == "separate"
        self.widths = [self.q_width * s.heads * s.head_dim, s.kv_heads * s.head_dim,
                       s.kv_heads * s.head_dim]

    def projections(self, s: TextSpec) -> None:
        """The linears ``project`` reads: q_proj (with the gate: ``q_width``), k_proj,
        v_proj."""
        self.q_proj = nn.Linear(s.hidden, self.q_width * s.heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)

    def fuse_projections(self, apply: bool = True) -> bool:
        """q_proj, k_proj, v_proj as one linear ``qkv_proj`` (``layers.fuse_into``): one
        GEMM where there were three, the same numbers in the same order."""
        return fuse_into(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"), apply)

    def linear_parts(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, T, D] -> q_proj's, k_proj's and v_proj's outputs (views of one when
        fused)."""
        if self.fused:
            q, k, v = self.qkv_proj(h).split(self.widths, -1)
            return q, k, v
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, T, D] -> q [B, T, H, d], k and v [B, T, K, d] (before norm and rotary)."""
        b, t, _ = h.shape
        s = self.s
        q, k, v = self.linear_parts(h)
        return (q.view(b, t, s.heads, s.head_dim), k.view(b, t, s.kv_heads, s.head_dim),
                v.view(b, t, s.kv_heads, s.head_dim))

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None]:
        """h [B, T, D] -> q, k, v as ``qkv`` and the output gate [B, T, H * d] (None: none)."""
        return (*self.qkv(h), None)

    def rotated(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused plain layout (``joint``): h [B, T, D] -> q [B, H, T, d] and k [B, K, T,
        d] with rotary (one call for both heads' kinds: it acts on each head alone), v
        [B, K, T, d]. The same numbers as ``project`` then rotary on each."""
        b, t, _ = h.shape
        s = self.s
        qkv = self.qkv_proj(h).view(b, t, s.heads + 2 * s.kv_heads, s.head_dim).transpose(1, 2)
        qk, v = qkv.split([s.heads + s.kv_heads, s.kv_heads], 1)
        q, k = apply_rotary(qk, cos, sin).split([s.heads, s.kv_heads], 1)
        return q, k, v

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        # h: [B, T, D]; cos/sin: [B, 1, T, r]; mask: [B, 1, T, P + T] bool, True = may attend;
        # past: k, v [B, K, P, d] (rotary applied). Returns the output and the new k, v.
        b, t, _ = h.shape
        gate = None
        if self.fused and self.joint:
            q, k, v = self.rotated(h, cos, sin)
        else:
            q, k, v, gate = self.project(h)
            if self.s.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            # (one pass over torch.cat([q, k], 1) measured 7x slower on the CPU: a strided
            # cat; ``rotated`` turns a view of one tensor instead)
            q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, d]
            k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, K, T, d]
            v = v.transpose(1, 2)
        k_all, v_all = (k, v) if past is None else (torch.cat([past[0], k], 2),
                                                    torch.cat([past[1], v], 2))
        heads = self.s.heads
        if heads != k_all.shape[1] and EXPAND_KV:
            g = heads // k_all.shape[1]  # [B, K, S, d] -> [B, H, S, d]
            k_all, v_all = k_all.repeat_interleave(g, 1), v_all.repeat_interleave(g, 1)
        a = attention(q, k_all, v_all, mask, heads != k_all.shape[1])
        a = a.transpose(1, 2).reshape(b, t, -1)  # [B, T, H * d]
        return self.o_proj(a if gate is None else a * torch.sigmoid(gate)), (k, v)


class GatedAttention(Attention):
    """Qwen3.5's full attention: ``q_proj`` rows are, per query head, its d query channels
    then its d gate channels (transformers' ``Qwen3_5Attention``)."""
    q_width = 2

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None]:
        b, t, _ = h.shape
        s = self.s
        qg, k, v = self.linear_parts(h)
        q, gate = qg.view(b, t, s.heads, 2 * s.head_dim).chunk(2, dim=-1)
        return (q, k.view(b, t, s.kv_heads, s.head_dim), v.view(b, t, s.kv_heads, s.head_dim),
                gate.reshape(b, t, -1))


class GroupedQKVAttention(Attention):
    """InternLM2's attention: one ``wqkv`` projection whose output rows, per key/value head
    in order, are that head's g = H / K query heads, then its key, then its value (each d
    rows): ``[K, g + 2, d]``. The split is the only difference (``qkv``)."""

    def projections(self, s: TextSpec) -> None:
        self.wqkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim,
                              bias=s.qkv_bias)

    def fuse_projections(self, apply: bool = True) -> bool:
        return False  # one projection already

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = h.shape
        s = self.s
        g = s.heads // s.kv_heads
        x = self.wqkv(h).view(b, t, s.kv_heads, g + 2, s.head_dim)
        return x[..., :g, :].reshape(b, t, s.heads, s.head_dim), x[..., g, :], x[..., g + 1, :]


# a spec's qkv_layout -> its attention module
QKV_LAYOUTS: dict[str, type[Attention]] = {"separate": Attention,
                                           "grouped": GroupedQKVAttention}


class MLP(nn.Module):
    fused = False  # gate_proj and up_proj as one ``gate_up_proj`` (``fuse_projections``)
    gate_up_proj: nn.Module  # once fused

    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.act = activation(s.act)

    def fuse_projections(self, apply: bool = True) -> bool:
        """gate_proj and up_proj as one linear ``gate_up_proj`` (``layers.fuse_into``)."""
        return fuse_into(self, "gate_up_proj", ("gate_proj", "up_proj"), apply)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, -1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each added to the residual stream."""

    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.self_attn = (GatedAttention if s.attn_gate else QKV_LAYOUTS[s.qkv_layout])(s)
        self.mlp = MLP(s)
        self.input_layernorm = make_norm(s, s.hidden)
        self.post_attention_layernorm = make_norm(s, s.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None = None, layout: Layout | None = None
                ) -> tuple[torch.Tensor, KV]:
        # x: [B, T, D]; as Attention.forward (layout: which new tokens are real, and how they
        # continue a state, for mixers that keep one). Returns x and this step's k, v.
        a, kv = self.mix(self.input_layernorm(x), cos, sin, mask, past, layout)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv

    def mix(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
            past: KV | None, layout: Layout | None) -> tuple[torch.Tensor, KV]:
        """The token mixer on the normed stream: attention here."""
        return self.self_attn(h, cos, sin, mask, past)


class LinearDecoderLayer(DecoderLayer):
    """A Gated DeltaNet layer (``linear_attn``) in the same residual frame; its "KV" is its
    state (module docstring), and it reads neither positions nor the attention mask."""

    def __init__(self, s: TextSpec) -> None:
        nn.Module.__init__(self)
        assert s.linear is not None  # TextSpec checks it
        self.linear_attn = GatedDeltaNet(s.hidden, s.linear, s.eps, s.act)
        self.mlp = MLP(s)
        self.input_layernorm = make_norm(s, s.hidden)
        self.post_attention_layernorm = make_norm(s, s.hidden)

    def mix(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
            past: KV | None, layout: Layout | None) -> tuple[torch.Tensor, KV]:
        return self.linear_attn(h, past, layout)


# a layer kind -> its module (module docstring: ``layer_kinds``)
LAYERS: dict[str, type[DecoderLayer]] = {"full": DecoderLayer, "linear": LinearDecoderLayer}


class TextDecoder(Decoder):
    """Token embeddings, the layers, the final norm and the LM head of one checkpoint."""

    spec: TextSpec

    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(LAYERS[kind](spec) for kind in spec.kinds)
        self.norm = make_norm(spec, spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the layers that keep per-token K/V (the others keep a state)
        self.full_layers = [i for i, kind in enumerate(spec.kinds) if kind == "full"]
        if spec.rope != "1d":
            # a buffer (moves with .to(device), never cast): indexing with a Python list
            # would copy the index to the device on every call, which a CUDA graph cannot
            # capture
            self.axes: torch.Tensor
            self.register_buffer("axes", torch.tensor(mrope_axes(spec)), persistent=False)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype,
               seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (1-D) or [3, B, T] (M-RoPE) long -> (cos, sin) each
        [B, 1, T, r] in ``dtype``, computed in float32. seq_lens [B]: each row's length
        once these tokens are in (dynamic scaling reads it)."""
        s = self.spec
        if s.rope == "1d" and s.rope_scaling == "none":
            return rotary(positions, s.rope_dim, s.rope_theta, dtype)
        if s.rope == "1d":
            return self._scaled_rotary(positions, dtype, seq_lens)
        inv = inverse_frequencies(s.rope_dim, s.rope_theta, positions.device)
        per_pair = positions.index_select(0, self.axes).permute(1, 2, 0).float()  # [B, T, r/2]
        cos, sin = rope_tables(per_pair * inv, dtype)
        return cos[:, None], sin[:, None]

    def _scaled_rotary(self, positions: torch.Tensor, dtype: torch.dtype,
                       seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """1-D rotary scaled as the spec says (``layers.scaled_inverse_frequencies``)."""
        s = self.spec
        if s.rope_scaling == "dynamic" and seq_lens is None:
            raise ValueError("dynamic rope scaling needs each row's length")
        inv, div = scaled_inverse_frequencies(s.rope_dim, s.rope_theta, s.rope_scaling,
                                              s.rope_factor, s.max_positions, seq_lens,
                                              positions.device)  # [B or 1, r/2]
        cos, sin = rope_tables(positions.float()[..., None] / div * inv[:, None], dtype)
        return cos[:, None], sin[:, None]

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, past: list[KV] | None = None,
                past_lengths: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, deepstack: DeepStack | None = None,
                state_at: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Prefill new tokens after an optional cached prefix; logits of the last real token.

        embeds: [B, T, D] new tokens, right-padded; lengths: [B] (1..T) real new tokens.
        past: per layer (k, v) [B, K, P, d], row b's first past_lengths[b] entries real (no
        past_lengths: all P). positions of the new tokens: 1-D [B, T] (None: past_lengths[b]
        + t) or M-RoPE [3, B, T] (required; ``qwen_vl/positions.py``; padding slots: any
        value). Keys: the real past, then the new tokens causally; padding queries attend to
        real tokens only, so no attention row is fully masked. deepstack: features added
        after the leading layers (module docstring). state_at [B, P] (0..lengths[b]): a
        linear layer's returned state has (1 + P) B rows, each row's after its last real
        token, then, column by column, each row's after its first state_at[b, p] new
        tokens (snapshots at the end of its image's prefix and of what its group shares,
        taken in this forward: ``linear_attention``).
        Returns (logits [B, V] float32, per layer (k, v) [B, K, T, d] of the new tokens).
        """
        x, new_kv = self._prefill_states(embeds, lengths, past, past_lengths, positions,
                                         deepstack, state_at)
        last = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # [B, D]
        return self.lm_head(self.norm(last)).float(), new_kv

    def prefill_hidden(self, embeds: torch.Tensor, lengths: torch.Tensor,
                       past: list[KV] | None = None, past_lengths: torch.Tensor | None = None,
                       *, positions: torch.Tensor | None = None,
                       deepstack: DeepStack | None = None,
                       state_at: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """As ``prefill`` (same inputs), but every new position's last hidden state after
        the final norm, ``[B, T, D]`` in the model's dtype (row b's first lengths[b] real):
        transformers' ``hidden_states[-1]``, what embeddings pool. No LM head."""
        x, new_kv = self._prefill_states(embeds, lengths, past, past_lengths, positions,
                                         deepstack, state_at)
        return self.norm(x), new_kv

    def _prefill_states(self, embeds: torch.Tensor, lengths: torch.Tensor,
                        past: list[KV] | None, past_lengths: torch.Tensor | None,
                        positions: torch.Tensor | None, deepstack: DeepStack | None,
                        state_at: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """``prefill``'s positions and masks around the stack: the last layer's output
        [B, T, D] before the final norm, and the new tokens' KV."""
        b, t, _ = embeds.shape
        dev = embeds.device
        p = 0 if past is None or not self.full_layers else past[self.full_layers[0]][0].shape[2]
        offset = past_lengths if past_lengths is not None else torch.full(
            (b,), p, dtype=torch.long, device=dev)
        pos = torch.arange(t, device=dev)
        positions = self._positions(positions, offset, pos, b)
        valid = pos[None, :] < lengths[:, None]  # [B, T]
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
        if past is not None:
            seen = torch.arange(p, device=dev)[None, :] < offset[:, None]  # [B, P]
            mask = torch.cat([seen[:, None, :].expand(b, t, p), mask], dim=2)  # [B, T, P+T]
        return self._layers(embeds, positions, mask, past, deepstack, Layout(valid, state_at),
                            offset + lengths)

    def _positions(self, positions: torch.Tensor | None, offset: torch.Tensor,
                   pos: torch.Tensor, b: int) -> torch.Tensor:
        """The new tokens' positions, checked: [B, T] (1-D; default offset + t) or
        [3, B, T] (M-RoPE, given)."""
        shape = (b, len(pos)) if self.spec.rope == "1d" else (3, b, len(pos))
        if positions is None and self.spec.rope == "1d":
            return offset[:, None] + pos[None, :]
        if positions is None or positions.shape != shape:
            raise ValueError(f"{self.spec.rope} positions must be {list(shape)}, got "
                             f"{None if positions is None else list(positions.shape)}")
        return positions

    def decode_step(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[KV],
                    key_valid: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """One token per row after cached keys.

        embeds: [B, 1, D]; positions: [B] long (M-RoPE: a generated token is text, the same
        position on all three axes, = its sequence index + the prompt's rope delta) or, for
        M-RoPE, [3, B]; kv: per layer (k, v) [B, K, S, d]; key_valid: [B, S] bool (False
        for padding holes). Returns (logits [B, V] float32, per layer (k, v) [B, K, 1, d]).
        A linear layer's entries are its state before and after the token (``join_cache``).
        """
        b = embeds.shape[0]
        if self.spec.rope == "1d":
            pos = positions[:, None]  # [B, 1]
        else:
            pos = (positions.expand(3, b) if positions.dim() == 1 else positions)[:, :, None]
        ones = torch.ones((b, 1), dtype=torch.bool, device=embeds.device)
        mask = torch.cat([key_valid, ones], dim=1)[:, None, :]  # [B, 1, S+1]
        seq_lens = positions + 1 if self.spec.rope == "1d" else None
        x, new_kv = self._layers(embeds, pos, mask, kv, seq_lens=seq_lens)
        return self.lm_head(self.norm(x[:, 0])).float(), new_kv

    def prefill_segments(self, embeds: torch.Tensor, positions: torch.Tensor,
                         segments: torch.Tensor, at: torch.Tensor,
                         past: list[KV] | None = None, past_lengths: torch.Tensor | None = None,
                         *, deepstack: DeepStack | None = None,
                         seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Several prompts sharing a prefix, one row each group (``engine/packing.py``):
        the shared tokens not cached, then each prompt's own tokens.

        embeds: [B, T, D]; positions: each token's in its own prompt, [B, T] (1-D) or
        [3, B, T] (M-RoPE); segments: [B, T] long, 0 for a shared token, k >= 1 for the
        row's k-th prompt's own tokens (after every shared one), -1 for padding; past: per
        layer (k, v) [B, K, P, d], row b's first past_lengths[b] real. A token attends to
        the row's real past, to the shared tokens and its own segment's tokens up to itself
        (block-causal); a padding token to the shared ones (and the past), so no row of the
        mask is empty. seq_lens [B]: each row's longest prompt (dynamic rotary scaling).
        Returns (logits [Q, V] float32 at the flat positions ``at [Q]`` = row * T + t, per
        layer (k, v) [B, K, T, d] of the new tokens). Full-attention layers only: a linear
        layer's one state per row cannot follow several prompts."""
        if "linear" in self.kinds:
            raise NotImplementedError("a linear-attention layer keeps one state per row: "
                                      "its prompts cannot share a row")
        b, t, _ = embeds.shape
        idx = torch.arange(t, device=embeds.device)
        key = segments[:, None, :]  # [B, 1, T]; -1 (padding) equals no query's segment
        query = segments.clamp(min=0)[:, :, None]  # [B, T, 1]; padding as a shared token
        mask = (idx[None, :] <= idx[:, None]) & ((key == 0) | (key == query))  # [B, T, T]
        if past is not None:
            p = past[0][0].shape[2]
            seen = torch.arange(p, device=embeds.device)[None, :] < past_lengths[:, None]  # type: ignore[index]
            mask = torch.cat([seen[:, None, :].expand(b, t, p), mask], dim=2)  # [B, T, P+T]
        x, new_kv = self._layers(embeds, positions, mask, past, deepstack, seq_lens=seq_lens)
        logits = self.lm_head(self.norm(x.flatten(0, 1).index_select(0, at)))  # [Q, V]
        return logits if logits.dtype == torch.float32 else logits.float(), new_kv

    def extend(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[KV],
               key_valid: torch.Tensor, new_mask: torch.Tensor,
               branches: Branches | None = None) -> tuple[torch.Tensor, list[KV]]:
        """N tokens per row after cached keys (``Decoder.extend``): ``decode_step`` for
        several tokens, which see each other only where ``new_mask [B, N, N]`` says (causal
        for a plain continuation; block-causal for a label set's choices side by side, each
        after the same prompt). Every row's valid cached keys are visible to all its new
        tokens, so a padding token (masked from the real ones) still attends to something.
        positions: [B, N] (1-D) or [3, B, N] (M-RoPE); a dynamic rope scaling takes each
        row's largest position + 1 as its length (module docstring). Returns (logits
        [B, N, V] float32, per layer (k, v) [B, K, N, d]).

        A linear layer (``kv``: its state after the prompt) cannot read a mask: ``branches``
        says which new tokens continue which row's state, one branch per run of tokens that
        ``new_mask`` chains (a label set: one per choice); its returned state has one row per
        branch. Required with linear layers (ValueError): tokens side by side in one row are
        not one sequence."""
        if branches is None and "linear" in self.kinds:
            raise ValueError("extend on a decoder with linear-attention layers needs the "
                             "branches its new tokens continue (linear_attention.Branches)")
        b, n, _ = embeds.shape
        mask = torch.cat([key_valid[:, None, :].expand(b, n, key_valid.shape[1]), new_mask],
                         dim=2)  # [B, N, S + N]
        seq_lens = positions.amax(-1) + 1 if self.spec.rope == "1d" else None  # [B]
        x, new_kv = self._layers(embeds, positions, mask, kv, seq_lens=seq_lens,
                                 layout=Layout(branches=branches))
        return self.lm_head(self.norm(x)).float(), new_kv

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.spec.kinds

    def join_cache(self, cache: list[KV], new: list[KV]) -> list[KV]:
        """A cache followed by a call's output, per layer: K/V appended along the tokens, a
        linear layer's state replaced by the one after the call."""
        return [n if kind == "linear" else (torch.cat([c[0], n[0]], 2),
                                            torch.cat([c[1], n[1]], 2))
                for kind, c, n in zip(self.kinds, cache, new)]

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per row, in layer order, the linear layers' (conv, recurrent) state tensors'
        shapes and dtypes (no linear layers: empty)."""
        return [shape for layer in self.layers if isinstance(layer, LinearDecoderLayer)
                for shape in layer.linear_attn.state_shapes()]

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past: list[KV] | None, deepstack: DeepStack | None = None,
                layout: Layout | None = None, seq_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[KV]]:
        # x: [B, T, D]; positions: [B, T] or [3, B, T]; mask: [B, T, P+T] bool; layout: the
        # linear layers' view of the new tokens (module docstring; None: all real, one
        # sequence per row); seq_lens: [B] each row's length after these tokens
        # (``rotary``; dynamic scaling reads it)
        cos, sin = self.rotary(positions, x.dtype, seq_lens)
        feats = deepstack.features if deepstack is not None else ()
        if len(feats) > len(self.layers):
            raise ValueError(f"{len(feats)} DeepStack features for {len(self.layers)} layers")
        new_kv = []
        mask = mask[:, None]  # [B, 1, T, P+T]: heads broadcast
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, None if past is None else past[i], layout)
            new_kv.append(kv)
            if i < len(feats):
                assert deepstack is not None
                x = x.index_put((deepstack.mask,), feats[i].to(x.dtype), accumulate=True)
        return x, new_kv

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Load from weights whose keys a family has normalised (``language_model.*``, and
        ``lm_head.weight`` unless tied). KeyError naming what is missing, or unexpected
        (module docstring: ``HARMLESS`` excepted); a shape that does not fit raises from
        ``copy_`` with that weight the last one read (``io.load_weights`` names it)."""
        own = self.state_dict()
        tied = self.spec.tie_embeddings
        need = {weight_key(n): t for n, t in own.items() if not (tied and n == "lm_head.weight")}
        missing = sorted(set(need) - set(sd))
        if missing:
            raise KeyError(f"checkpoint lacks language-model weights: {missing[:5]} "
                           f"({len(missing)} missing)")
        unexpected = sorted(k for k in sd if k.startswith("language_model.") and k not in need
                            and not k.endswith(HARMLESS))
        if unexpected:
            raise KeyError(f"language-model weights the config does not expect: "
                           f"{unexpected[:5]} ({len(unexpected)} unexpected)")
        with torch.no_grad():
            for key, t in need.items():
                t.copy_(sd[key])
