"""Qwen2 decoder (the language model of InternVL2.5/3) for batched prefill, on SDPA.

Shared by the families whose text model is Qwen2; ``hf_key`` maps our parameter names to
the HF decoder's (``language_model.`` prefixed, the normalised form every family's
``normalise_key`` produces).

The engine feeds ``inputs_embeds`` (text embeddings with image embeddings written into the
``<IMG_CONTEXT>`` span) for a right-padded batch and reads the hidden state of each sequence's
last real token (``prefill``: the yes/no path, the final norm and LM head on that row only),
or every position's last hidden state (``prefill_hidden``: embeddings). Weights and maths
follow transformers' ``Qwen2Model`` (RMSNorm, rotary position embedding with ``rotate_half``,
grouped-query attention, SwiGLU MLP, q/k/v bias); ``tests/models/test_internvl_reference.py``
checks logits, ``tests/pipeline/test_embed_reference.py`` hidden states, against transformers.

Shapes: B sequences, T padded length, D hidden, H query heads, K key/value heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.models.base import KV, Decoder, DeepStack
from vlmbatch.models.layers import FusedRMSNorm, rope, rotary


@dataclass(frozen=True)
class TextSpec:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    eps: float
    rope_theta: float
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Repeat K/V per query head instead of SDPA's ``enable_gqa``? No, on both devices, measured
# with ``bench/attention.py`` at Qwen2-0.5B's layout:
# - CPU: ``enable_gqa`` level for a long prefill, 2-4x faster for short prompts after a cached
#   prefix, ~20x at decode (docs/engine.md);
# - CUDA (H200, bf16, bench/gpu_check.sh, 2026-11-30): ``enable_gqa`` takes the math kernel
#   (flash takes no mask, memory-efficient no GQA) and expanded K/V the memory-efficient one,
#   yet ``enable_gqa`` is still faster: expanding costs 0.61x (16 prompts of 32 after 512
#   cached), 0.79x (4 x 1024) and 0.21x (decode, 64 rows after 600), because the
#   ``repeat_interleave`` copy costs more than the kernel saves at these sizes.
# Kept as a switch so that tests check both forms agree.
EXPAND_KV = False


class DecoderLayer(nn.Module):
    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.s = s
        d = s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.heads * d)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * d)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * d)
        self.o_proj = nn.Linear(s.heads * d, s.hidden, bias=False)
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.input_layernorm = FusedRMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = FusedRMSNorm(s.hidden, s.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        # x: [B, T, D]; cos/sin: [B, 1, T, d]; mask: [B, 1, T, P + T] bool, True = may attend;
        # past: k, v [B, K, P, d] (rotary already applied). Returns x and this step's k, v.
        b, t, _ = x.shape
        s = self.s
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        # (one pass over torch.cat([q, k], 1) measured 7x slower on the CPU: a strided cat)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k_all, v_all = (k, v) if past is None else (torch.cat([past[0], k], 2),
                                                    torch.cat([past[1], v], 2))
        if s.heads != s.kv_heads and EXPAND_KV:
            g = s.heads // s.kv_heads  # [B, K, S, d] -> [B, H, S, d]
            k_all, v_all = k_all.repeat_interleave(g, 1), v_all.repeat_interleave(g, 1)
        a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                           enable_gqa=s.heads != k_all.shape[1])
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), (k, v)


class Qwen2LM(Decoder):
    spec: TextSpec

    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.layers))
        self.norm = FusedRMSNorm(spec.hidden, spec.eps)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prefill_last(self, embeds: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded batch -> logits of each sequence's last real token, [B, V] float32."""
        return self.prefill(embeds, lengths)[0]

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, past: list[KV] | None = None,
                past_lengths: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None,
                deepstack: DeepStack | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Prefill new tokens after an optional cached prefix; logits of the last real token.

        embeds: [B, T, D] new tokens, right-padded; lengths: [B] (1..T) real new tokens.
        past: per layer (k, v) [B, K, P, d], each row's first past_lengths[b] entries real.
        New token t of row b sits at position past_lengths[b] + t unless ``positions``
        [B, T] says otherwise. Padding attends to real tokens only, so no attention row is
        fully masked. No DeepStack (a Qwen3-VL input).
        Returns (logits [B, V] float32, per layer (k, v) [B, K, T, d] of the new tokens).
        """
        if deepstack is not None:
            raise ValueError("the Qwen2 decoder takes no DeepStack features")
        x, new_kv = self._prefill_states(embeds, lengths, past, past_lengths, positions)
        last = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # [B, D]
        return self.lm_head(self.norm(last)).float(), new_kv

    def prefill_hidden(self, embeds: torch.Tensor, lengths: torch.Tensor,
                       past: list[KV] | None = None, past_lengths: torch.Tensor | None = None,
                       *, positions: torch.Tensor | None = None,
                       deepstack: DeepStack | None = None) -> tuple[torch.Tensor, list[KV]]:
        """As ``prefill``, but the last hidden states of every new position (after the final
        norm: transformers' ``hidden_states[-1]``), for embeddings; no LM head.

        Returns (hidden [B, T, D] in the model's dtype, row b's first lengths[b] real; per
        layer (k, v) [B, K, T, d] of the new tokens). Causal like ``prefill``: position t
        sees the cached prefix and new positions <= t of its own row only."""
        if deepstack is not None:
            raise ValueError("the Qwen2 decoder takes no DeepStack features")
        x, new_kv = self._prefill_states(embeds, lengths, past, past_lengths, positions)
        return self.norm(x), new_kv

    def _prefill_states(self, embeds: torch.Tensor, lengths: torch.Tensor,
                        past: list[KV] | None, past_lengths: torch.Tensor | None,
                        positions: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, list[KV]]:
        """The decoder stack over new tokens (``prefill``'s masks and positions): the last
        layer's output [B, T, D] before the final norm, and the new tokens' KV."""
        b, t, _ = embeds.shape
        device = embeds.device
        pos = torch.arange(t, device=device)
        offset = (past_lengths if past_lengths is not None
                  else torch.zeros(b, dtype=torch.long, device=device))
        if positions is None:
            positions = offset[:, None] + pos[None, :]  # [B, T]
        valid = pos[None, :] < lengths[:, None]  # [B, T]
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
        if past is not None:
            p = past[0][0].shape[2]
            seen = torch.arange(p, device=device)[None, :] < offset[:, None]  # [B, P]
            mask = torch.cat([seen[:, None, :].expand(b, t, p), mask], dim=2)  # [B, T, P+T]
        return self._layers(embeds, positions, mask, past)

    def decode_step(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[KV],
                    key_valid: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """One token per row after cached keys.

        embeds: [B, 1, D]; positions: [B] long; kv: per layer (k, v) [B, K, S, d];
        key_valid: [B, S] bool (False for padding holes). Returns (logits [B, V] float32,
        per layer (k, v) [B, K, 1, d] of this token).
        """
        b = embeds.shape[0]
        ones = torch.ones((b, 1), dtype=torch.bool, device=embeds.device)
        mask = torch.cat([key_valid, ones], dim=1)[:, None, :]  # [B, 1, S+1]
        x, new_kv = self._layers(embeds, positions[:, None], mask, kv)
        return self.lm_head(self.norm(x[:, 0])).float(), new_kv

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past: list[KV] | None) -> tuple[torch.Tensor, list[KV]]:
        # x: [B, T, D]; positions: [B, T]; mask: [B, T, P+T] bool
        cos, sin = rotary(positions, self.spec.head_dim, self.spec.rope_theta, x.dtype)
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask[:, None], None if past is None else past[i])
            new_kv.append(kv)
        return x, new_kv

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Load from keys normalised to ``language_model.*`` and ``lm_head.weight``."""
        own = self.state_dict()
        missing = []
        with torch.no_grad():
            for name, t in own.items():
                if name == "lm_head.weight" and self.spec.tie_embeddings:
                    continue
                key = hf_key(name)
                if key in sd:
                    t.copy_(sd[key])
                else:
                    missing.append(key)
        if missing:
            raise KeyError(f"checkpoint lacks language-model weights: {missing[:5]} "
                           f"({len(missing)} missing)")


_SUBMODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def our_name(key: str) -> str | None:
    """The HF Qwen2 decoder-layer key -> our parameter name (``language_model.layers.0.
    self_attn.q_proj.weight`` -> ``layers.0.q_proj.weight``); None for other keys."""
    parts = key.split(".")
    if parts[:2] != ["language_model", "layers"] or len(parts) != 6:
        return None
    return ".".join([*parts[1:3], *parts[4:]])


def hf_key(name: str) -> str:
    """Our parameter name -> the HF Qwen2 key (``layers.0.q_proj.weight`` ->
    ``language_model.layers.0.self_attn.q_proj.weight``)."""
    if name == "lm_head.weight":
        return name
    parts = name.split(".")
    if parts[0] == "layers" and parts[2] in _SUBMODULE:
        parts.insert(2, _SUBMODULE[parts[2]])
    return "language_model." + ".".join(parts)
