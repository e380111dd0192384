"""Qwen2 decoder (the language model of InternVL2.5/3) for batched prefill, on SDPA.

The engine feeds ``inputs_embeds`` (text embeddings with image embeddings written into the
``<IMG_CONTEXT>`` span) for a right-padded batch and reads the hidden state of each sequence's
last real token. Weights and maths follow transformers' ``Qwen2Model`` (RMSNorm, rotary
position embedding with ``rotate_half``, grouped-query attention, SwiGLU MLP, q/k/v bias);
``tests/pipeline/test_reference.py`` checks logits against the transformers model.

Shapes: B sequences, T padded length, D hidden, H query heads, K key/value heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vit_trt.encoder import RMSNorm


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


def rotary(positions: torch.Tensor, head_dim: int, theta: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> (cos, sin) each [B, 1, T, d], computed in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


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
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]; cos/sin: [B, 1, T, d]; mask: [B, 1, T, T] bool, True = may attend
        b, t, _ = x.shape
        s = self.s
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           enable_gqa=s.heads != s.kv_heads)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Qwen2LM(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prefill_last(self, embeds: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded batch -> logits of each sequence's last real token.

        embeds: [B, T, D]; lengths: [B] long (>= 1, <= T). Returns [B, V] float32.
        Padding positions attend to real tokens only, so no row is fully masked.
        """
        b, t, _ = embeds.shape
        device = embeds.device
        pos = torch.arange(t, device=device)
        positions = pos.expand(b, t)
        valid = pos[None, :] < lengths[:, None]  # [B, T]
        causal = pos[None, :] <= pos[:, None]  # [T(query), T(key)]
        mask = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, T, T]
        cos, sin = rotary(positions, self.spec.head_dim, self.spec.rope_theta, embeds.dtype)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        last = x[torch.arange(b, device=device), lengths - 1]  # [B, D]
        return self.lm_head(self.norm(last)).float()

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Load from keys normalised to ``language_model.*`` and ``lm_head.weight``."""
        own = self.state_dict()
        missing = []
        with torch.no_grad():
            for name, t in own.items():
                if name == "lm_head.weight" and self.spec.tie_embeddings:
                    continue
                key = _hf_key(name)
                if key in sd:
                    t.copy_(sd[key])
                else:
                    missing.append(key)
        if missing:
            raise KeyError(f"checkpoint lacks language-model weights: {missing[:5]} "
                           f"({len(missing)} missing)")


_SUBMODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _hf_key(name: str) -> str:
    """Our parameter name -> the HF Qwen2 key (``layers.0.q_proj.weight`` ->
    ``language_model.layers.0.self_attn.q_proj.weight``)."""
    if name == "lm_head.weight":
        return name
    parts = name.split(".")
    if parts[0] == "layers" and parts[2] in _SUBMODULE:
        parts.insert(2, _SUBMODULE[parts[2]])
    return "language_model." + ".".join(parts)
