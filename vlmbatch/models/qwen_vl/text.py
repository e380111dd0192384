"""Qwen-VL decoders with M-RoPE, for batched prefill and decode on SDPA.

Qwen2-VL / Qwen2.5-VL: the Qwen2 decoder (q/k/v bias, RMSNorm, SwiGLU) with *sectioned*
M-RoPE: the head's rotary frequency pairs are split ``mrope_section = (t, h, w)`` and each
section turns with that axis' position. Qwen3-VL: the Qwen3 decoder (RMSNorm of q and k over
the head dim, no bias) with *interleaved* M-RoPE (pair j follows h if j % 3 == 1 and
j < 3 * section_h, w if j % 3 == 2 and j < 3 * section_w, else t), and DeepStack: the vision
tower's extra features are added to the hidden states at the image positions after each of
the first ``len(features)`` decoder layers.

The interface is ``models.base.Decoder`` (as ``models/qwen2.py``'s ``Qwen2LM``) with M-RoPE
positions, so the engine drives either. Shapes: B rows, T new tokens (right-padded), P cached
tokens, D hidden, H query heads, K key/value heads, d head dim. K/V are returned with rotary
applied, so a cached prefix is reusable as is; K/V are never repeated per query head (SDPA
``enable_gqa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.models.base import KV, Decoder, DeepStack
from vlmbatch.models.layers import FusedRMSNorm as RMSNorm
from vlmbatch.models.layers import activation, inverse_frequencies, rope_tables
from vlmbatch.models.layers import rope as rotate
from vlmbatch.models.qwen_vl.spec import TextSpec

__all__ = ["KV", "DeepStack", "QwenVLText", "mrope_axes"]  # KV, DeepStack: models.base's


def mrope_axes(spec: TextSpec) -> list[int]:
    """Which position axis (0 = t, 1 = h, 2 = w) turns each of the d/2 frequency pairs."""
    t, h, w = spec.mrope_section
    if not spec.mrope_interleaved:
        return [0] * t + [1] * h + [2] * w
    return [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
            for j in range(t + h + w)]


class Attention(nn.Module):
    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.eps)
            self.k_norm = RMSNorm(s.head_dim, s.eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        # h: [B, T, D]; cos/sin: [B, 1, T, d]; mask: [B, 1, T, P+T] bool, True = may attend
        b, t, _ = h.shape
        s = self.s
        q = self.q_proj(h).view(b, t, s.heads, s.head_dim)
        k = self.k_proj(h).view(b, t, s.kv_heads, s.head_dim)
        v = self.v_proj(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)  # [B, K, T, d]
        k_all, v_all = (k, v) if past is None else (torch.cat([past[0], k], 2),
                                                    torch.cat([past[1], v], 2))
        a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                           enable_gqa=s.heads != s.kv_heads)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.act = activation(s.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: TextSpec) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class QwenVLText(Decoder):
    """The decoder + final norm + LM head of one Qwen-VL checkpoint."""

    spec: TextSpec

    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # a buffer (moves with .to(device), never cast): indexing with a Python list would copy
        # the index to the device on every call, which a CUDA graph cannot capture
        self.axes: torch.Tensor
        self.register_buffer("axes", torch.tensor(mrope_axes(spec)), persistent=False)

    def rotary(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, B, T] long -> (cos, sin) each [B, 1, T, d] in ``dtype``."""
        inv = inverse_frequencies(self.spec.head_dim, self.spec.rope_theta, positions.device)
        per_pair = positions.index_select(0, self.axes).permute(1, 2, 0).float()  # [B, T, d/2]
        cos, sin = rope_tables(per_pair * inv, dtype)
        return cos[:, None], sin[:, None]

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, past: list[KV] | None = None,
                past_lengths: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None,
                deepstack: DeepStack | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Prefill new tokens after an optional cached prefix; logits of the last real token.

        embeds: [B, T, D] new tokens, right-padded; lengths: [B] (1..T) real new tokens.
        past: per layer (k, v) [B, K, P, d], row b's first past_lengths[b] entries real.
        positions: [3, B, T] long M-RoPE positions of the new tokens (``positions.py``;
        padding slots: any value). Keys: the real past, then the new tokens causally; padding
        queries attend to real tokens only, so no attention row is fully masked.
        Returns (logits [B, V] float32, per layer (k, v) [B, K, T, d] of the new tokens).
        """
        x, new_kv = self._prefill_states(embeds, lengths, past, past_lengths, positions,
                                         deepstack)
        last = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # [B, D]
        return self.lm_head(self.norm(last)).float(), new_kv

    def prefill_hidden(self, embeds: torch.Tensor, lengths: torch.Tensor,
                       past: list[KV] | None = None, past_lengths: torch.Tensor | None = None,
                       *, positions: torch.Tensor | None = None,
                       deepstack: DeepStack | None = None) -> tuple[torch.Tensor, list[KV]]:
        """As ``prefill`` (same inputs, DeepStack added after the leading layers as there),
        but every new position's last hidden state after the final norm, ``[B, T, D]`` in the
        model's dtype (row b's first lengths[b] real): transformers' ``hidden_states[-1]``
        (= its ``last_hidden_state``), what embeddings pool. No LM head."""
        x, new_kv = self._prefill_states(embeds, lengths, past, past_lengths, positions,
                                         deepstack)
        return self.norm(x), new_kv

    def _prefill_states(self, embeds: torch.Tensor, lengths: torch.Tensor,
                        past: list[KV] | None, past_lengths: torch.Tensor | None,
                        positions: torch.Tensor | None, deepstack: DeepStack | None
                        ) -> tuple[torch.Tensor, list[KV]]:
        """``prefill``'s masks around the decoder stack: the last layer's output [B, T, D]
        before the final norm, and the new tokens' KV."""
        b, t, _ = embeds.shape
        dev = embeds.device
        if positions is None or positions.shape != (3, b, t):
            raise ValueError(f"M-RoPE positions must be [3, B, T] = {[3, b, t]}, got "
                             f"{None if positions is None else list(positions.shape)}")
        pos = torch.arange(t, device=dev)
        valid = pos[None, :] < lengths[:, None]  # [B, T]
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
        if past is not None:
            p = past[0][0].shape[2]
            offset = past_lengths if past_lengths is not None else torch.full(
                (b,), p, dtype=torch.long, device=dev)
            seen = torch.arange(p, device=dev)[None, :] < offset[:, None]  # [B, P]
            mask = torch.cat([seen[:, None, :].expand(b, t, p), mask], dim=2)  # [B, T, P+T]
        return self._layers(embeds, positions, mask, past, deepstack)

    def decode_step(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[KV],
                    key_valid: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """One token per row after cached keys.

        embeds: [B, 1, D]; positions: [B] long (a generated token is text: the same position
        on all three axes, = its sequence index + the prompt's rope delta) or [3, B];
        kv: per layer (k, v) [B, K, S, d]; key_valid: [B, S] bool (False for padding holes).
        Returns (logits [B, V] float32, per layer (k, v) [B, K, 1, d] of this token).
        """
        b = embeds.shape[0]
        pos3 = positions.expand(3, b) if positions.dim() == 1 else positions
        ones = torch.ones((b, 1), dtype=torch.bool, device=embeds.device)
        mask = torch.cat([key_valid, ones], dim=1)[:, None, :]  # [B, 1, S+1]
        x, new_kv = self._layers(embeds, pos3[:, :, None], mask, kv, None)
        return self.lm_head(self.norm(x[:, 0])).float(), new_kv

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past: list[KV] | None, deepstack: DeepStack | None
                ) -> tuple[torch.Tensor, list[KV]]:
        # x: [B, T, D]; positions: [3, B, T]; mask: [B, T, P+T] bool
        cos, sin = self.rotary(positions, x.dtype)
        feats = deepstack.features if deepstack is not None else ()
        if len(feats) > len(self.layers):
            raise ValueError(f"{len(feats)} DeepStack features for {len(self.layers)} layers")
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask[:, None], None if past is None else past[i])
            new_kv.append(kv)
            if i < len(feats):
                assert deepstack is not None
                x = x.index_put((deepstack.mask,), feats[i].to(x.dtype), accumulate=True)
        return x, new_kv

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Load the decoder from transformers' keys: ``model.language_model.*`` (Qwen3-VL,
        transformers >= 4.52), ``model.*`` (Qwen2/2.5-VL as the hub and ``save_pretrained``
        write them), ``language_model.*``; plus ``lm_head.weight`` unless tied."""
        got = {name: t for key, t in sd.items() if (name := our_name(key)) is not None}
        own = self.state_dict()
        need = {k for k in own if not (k == "lm_head.weight" and self.spec.tie_embeddings)}
        missing = sorted(need - set(got))
        if missing:
            raise KeyError(f"checkpoint lacks language-model weights: {missing[:5]} "
                           f"({len(missing)} missing)")
        unexpected = sorted(set(got) - set(own))
        if unexpected:
            raise KeyError(f"language-model weights the config does not expect: "
                           f"{unexpected[:5]}")
        if self.spec.tie_embeddings:
            got.pop("lm_head.weight", None)
        self.load_state_dict(got, strict=False)  # strict but for a tied head (checked above)


def our_name(key: str) -> str | None:
    if key in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for prefix in ("model.language_model.", "language_model.model.", "language_model.",
                   "model."):
        if key.startswith(prefix):
            name = key[len(prefix):]
            return None if name.startswith("visual.") else name
    return None
