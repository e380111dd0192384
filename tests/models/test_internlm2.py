"""The InternLM2 decoder (the one decoder's grouped-qkv spec) against two references, fp32:

- an independent forward written here from the published ``modeling_internlm2.py``
  (InternVL's copy): ``wqkv`` split with its rearrange ``b q (h gs d) -> b q h gs d``,
  ``gs = 2 + H / K``, queries the first ``H / K`` of each group, then key, then value; its
  dynamic-NTK rotary (a cos/sin table over ``kv_seq_len`` positions, rebuilt with a larger
  base when ``kv_seq_len`` passes the cached length, the cache starting at
  ``max_position_embeddings``); eager attention with ``repeat_kv``; RMSNorm; SwiGLU;
  ``output``. It reads the original layout's weights by their InternLM2 names;
- transformers' ``LlamaForCausalLM`` on the same weights re-laid out (the HF-native twin's
  text model: what the conversion script makes of an InternLM2 checkpoint).

Both to 1e-5 on prompts within and past ``max_position_embeddings`` (32 here, so the
dynamic scaling is exercised), batched and one at a time, and over decode steps; and the
injected faults (``fault_injection.py``) miss the published forward by > 100x that.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.models.fault_injection import FAULTS, with_fault
from tests.models.internvl_original_helpers import make_pair, modules
from vlmbatch.models.io import raw_state_dict

TOL = 1e-5
LENGTHS = (45, 20)  # past and within max_position_embeddings = 32


class PublishedInternLM2:
    """InternLM2ForCausalLM's forward for one sequence, from the published equations."""

    def __init__(self, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        self.w = {k[len("language_model."):]: t for k, t in sd.items()
                  if k.startswith("language_model.")}
        self.c = cfg
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg["hidden_size"] // self.heads
        self.max_pos = cfg["max_position_embeddings"]
        self.set_cache(self.max_pos)  # built at init for max_position_embeddings

    def set_cache(self, seq_len: int) -> None:
        """_set_cos_sin_cache of InternLM2DynamicNTKScalingRotaryEmbedding."""
        self.cached, base, dim = seq_len, self.c["rope_theta"], self.d
        if seq_len > self.max_pos:
            f = self.c["rope_scaling"]["factor"]
            base = base * ((f * seq_len / self.max_pos) - (f - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.einsum("i,j->ij", torch.arange(seq_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(var + self.c["rms_norm_eps"]))

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def attention(self, x: torch.Tensor, i: int, past: list, pos: torch.Tensor) -> torch.Tensor:
        q_len, gs = x.shape[0], 2 + self.heads // self.kv
        qkv = self.linear(x, f"model.layers.{i}.attention.wqkv")
        qkv = qkv.view(q_len, self.kv, gs, self.d)  # rearrange 'q (h gs d) -> q h gs d'
        q = qkv[:, :, : gs - 2].reshape(q_len, self.heads, self.d).transpose(0, 1)
        k, v = qkv[:, :, -2].transpose(0, 1), qkv[:, :, -1].transpose(0, 1)
        kv_seq_len = q_len + (past[i][0].shape[1] if past[i] is not None else 0)
        if kv_seq_len > self.cached:
            self.set_cache(kv_seq_len)
        cos, sin = self.cos[pos][None], self.sin[pos][None]

        def rotate_half(t: torch.Tensor) -> torch.Tensor:
            return torch.cat((-t[..., self.d // 2:], t[..., : self.d // 2]), dim=-1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past[i] is not None:
            k, v = torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1)
        past[i] = (k, v)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # repeat_kv
        w = q @ k.transpose(1, 2) / math.sqrt(self.d)
        causal = torch.ones(q_len, kv_seq_len, dtype=torch.bool).tril(kv_seq_len - q_len)
        w = torch.softmax(w.masked_fill(~causal, float("-inf")), -1)
        return self.linear((w @ v).transpose(0, 1).reshape(q_len, -1),
                           f"model.layers.{i}.attention.wo")

    def __call__(self, embeds: torch.Tensor, past: list | None = None) -> tuple[torch.Tensor,
                                                                                   list]:
        """embeds [T, D] after ``past`` (per layer k, v) -> (logits [T, V], new past)."""
        n_layers = self.c["num_hidden_layers"]
        past = past or [None] * n_layers
        start = 0 if past[0] is None else past[0][0].shape[1]
        pos = torch.arange(start, start + embeds.shape[0])
        h = embeds
        for i in range(n_layers):
            pre = f"model.layers.{i}."
            h = h + self.attention(self.norm(h, pre + "attention_norm.weight"), i, past, pos)
            x = self.norm(h, pre + "ffn_norm.weight")
            ff = F.silu(self.linear(x, pre + "feed_forward.w1")) * self.linear(
                x, pre + "feed_forward.w3")
            h = h + self.linear(ff, pre + "feed_forward.w2")
        return self.linear(self.norm(h, "model.norm.weight"), "output"), past


@pytest.fixture(scope="module")
def internlm2(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    hf, original = make_pair(tmp_path_factory.mktemp("internlm2"), "internvl2_internlm2")
    cfg = json.loads((original / "config.json").read_text())["llm_config"]
    published = PublishedInternLM2(raw_state_dict(original), cfg)
    return modules(original)[1], published, hf, cfg


def embeds(n: int, hidden: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def fresh_published(p: PublishedInternLM2) -> PublishedInternLM2:
    p.set_cache(p.max_pos)  # a fresh model (the published module keeps its largest table)
    return p


def batched_logits(llm: torch.nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
    """Our last-token logits of each sequence of ``xs``, right-padded in one prefill."""
    t = max(len(x) for x in xs)
    batch = torch.stack([F.pad(x, (0, 0, 0, t - len(x))) for x in xs])
    with torch.no_grad():
        return llm.prefill(batch, torch.tensor([len(x) for x in xs]))[0]


def test_prefill_matches_the_published_forward(internlm2) -> None:  # noqa: ANN001
    llm, published, _, cfg = internlm2
    xs = [embeds(n, cfg["hidden_size"], n) for n in LENGTHS]
    got = batched_logits(llm, xs)
    for row, x in zip(got, xs):
        with torch.no_grad():
            want = fresh_published(published)(x)[0][-1]
        assert (row - want).abs().max() <= TOL
        assert want.abs().max() > 1.0


def test_decode_matches_the_published_forward(internlm2) -> None:  # noqa: ANN001
    """Prefill 30 tokens, then 6 one at a time past max_position_embeddings: the published
    model rebuilds its table with a larger base each step, keeping the cached keys."""
    llm, published, _, cfg = internlm2
    x = embeds(36, cfg["hidden_size"], 7)
    with torch.no_grad():
        want, past = fresh_published(published)(x[:30])
        _, kv = llm.prefill(x[None, :30], torch.tensor([30]))
        for i in range(30, 36):
            step, past = published(x[i: i + 1], past)
            got, new = llm.decode_step(x[None, i: i + 1], torch.tensor([i]), kv,
                                       torch.ones(1, i, dtype=torch.bool))
            kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                  for (k, v), (nk, nv) in zip(kv, new)]
            assert (got[0] - step[-1]).abs().max() <= TOL


def test_matches_transformers_llama_on_the_relaid_weights(internlm2) -> None:  # noqa: ANN001
    llm, _, hf, _ = internlm2
    text = json.loads((Path(hf) / "config.json").read_text())["text_config"]
    ref = LlamaForCausalLM(LlamaConfig(**text)).eval()
    sd = raw_state_dict(Path(hf))
    ref.load_state_dict({k[len("language_model."):]: t for k, t in sd.items()
                         if k.startswith("language_model.")})
    xs = [embeds(n, text["hidden_size"], n) for n in LENGTHS]
    got = batched_logits(llm, xs)
    for row, x in zip(got, xs):
        rot = ref.model.rotary_emb  # fresh table per prompt (test_internvl_reference.fresh)
        rot.inv_freq, rot.max_seq_len_cached = rot.original_inv_freq, rot.original_max_seq_len
        with torch.no_grad():
            want = ref(inputs_embeds=x[None]).logits[0, -1]
        assert (row - want).abs().max() <= TOL


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_faults_are_caught(internlm2, fault: str) -> None:  # noqa: ANN001
    """A dropped wqkv bias or two query heads swapped in the fused rows miss the published
    forward by > 100x the tolerance."""
    llm, published, _, cfg = internlm2
    x = embeds(LENGTHS[0], cfg["hidden_size"], 3)
    got = batched_logits(with_fault(llm, FAULTS[fault]), [x])[0]
    with torch.no_grad():
        want = fresh_published(published)(x)[0][-1]
    assert (got - want).abs().max() > 100 * TOL
