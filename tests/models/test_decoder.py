"""The one text decoder (``models/decoder.py``): what it decides that its two predecessors did
differently, its spec's checks, partial rotary against the published formula, and one weight
naming for every family. Its parity with transformers is each family's reference test
(``test_internvl_reference.py``, ``test_qwen_vl_reference.py``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmbatch.engine.loading import load_model, read_spec
from vlmbatch.models import decoder
from vlmbatch.models.base import weight_key
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.decoder import TextDecoder, TextSpec
from vlmbatch.models.io import raw_state_dict
from vlmbatch.models.paths import DEFAULT_MODEL, DEFAULT_QWEN_MODEL
from vlmbatch.models.registry import family_for

BASE = TextSpec(vocab=50, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                intermediate=48, eps=1e-6, rope_theta=1e4, tie_embeddings=False)
MROPE = dataclasses.replace(BASE, rope="mrope-interleaved", mrope_section=(2, 3, 3),
                            qk_norm=True, qkv_bias=False)


def random_decoder(spec: TextSpec, seed: int = 0) -> TextDecoder:
    """Every parameter drawn N(0, 0.3) (biases and norms included), eval mode."""
    torch.manual_seed(seed)
    m = TextDecoder(spec).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def positions(spec: TextSpec, start: int, t: int, b: int = 2) -> torch.Tensor | None:
    """Text positions start..start+t-1: [3, B, T] for M-RoPE, None (the default) for 1-D."""
    if spec.rope == "1d":
        return None
    return torch.arange(start, start + t).expand(3, b, t).contiguous()


@pytest.mark.parametrize("spec", [BASE, MROPE], ids=["1d", "mrope"])
def test_past_without_lengths_means_every_cached_position_is_real(spec: TextSpec) -> None:
    """The decided semantics: prefill k tokens, then the rest after their KV with no
    ``past_lengths`` = one prefill of the whole (Qwen2's decoder used to see no past then,
    and restart 1-D positions at 0)."""
    m = random_decoder(spec)
    x = torch.randn(2, 9, spec.hidden, generator=torch.Generator().manual_seed(1))
    full = torch.tensor([9, 9])
    with torch.no_grad():
        whole, _ = m.prefill(x, full, positions=positions(spec, 0, 9))
        _, kv = m.prefill(x[:, :5], torch.tensor([5, 5]), positions=positions(spec, 0, 5))
        split, _ = m.prefill(x[:, 5:], full - 5, kv, positions=positions(spec, 5, 4))
        given, _ = m.prefill(x[:, 5:], full - 5, kv, torch.tensor([5, 5]),
                             positions=positions(spec, 5, 4))
    assert torch.equal(split, given)
    assert (split - whole).abs().max() <= 1e-5
    assert (whole.abs().max()) > 1.0  # not a vacuous comparison


def test_partial_rotary_matches_the_published_formula() -> None:
    """``rotary_dim`` r < d: the first r channels of q and k turned as transformers'
    ``apply_rotary_pos_emb`` with ``partial_rotary_factor`` (inverse frequencies over r,
    ``rotate_half`` on the rotated part), the rest passed; written out here from that
    definition. r = d is the full rotary exactly."""
    spec = dataclasses.replace(BASE, rotary_dim=8, layers=1)
    m = random_decoder(spec)
    x = torch.randn(2, 6, spec.hidden, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, kv = m.prefill(x, torch.tensor([6, 6]))
        attn = m.layers[0].self_attn
        k = attn.k_proj(m.layers[0].input_layernorm(x)).view(2, 6, 2, 16).transpose(1, 2)
    r, theta = 8, spec.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, r, 2).float() / r)
    ang = torch.arange(6).float()[:, None] * inv[None]  # [T, r/2]
    emb = torch.cat([ang, ang], -1)
    rot, rest = k[..., :r], k[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], -1)  # rotate_half
    want = torch.cat([rot * emb.cos() + half * emb.sin(), rest], -1)
    assert (kv[0][0] - want).abs().max() <= 1e-5
    assert torch.equal(kv[0][0][..., r:], k[..., r:])  # the pass-through part untouched
    full = random_decoder(dataclasses.replace(BASE, rotary_dim=16))
    with torch.no_grad():
        a = full.prefill(x, torch.tensor([6, 4]))[0]
        b = random_decoder(BASE).prefill(x, torch.tensor([6, 4]))[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize(("change", "message"), [
    ({"kv_heads": 3}, "do not share"),
    ({"rope": "2d"}, "not one of"),
    ({"rope": "mrope-sectioned"}, "M-RoPE needs one"),
    ({"rope": "mrope-sectioned", "mrope_section": (2, 3, 4)}, "summing to the rotary pairs"),
    ({"rotary_dim": 7}, "must be even"),
    ({"layer_kinds": ("full",)}, "1 layer kinds for 2 layers"),
    ({"layer_kinds": ("full", "moe")}, r"\['moe'\] are not implemented"),
    ({"layer_kinds": ("full", "linear")}, r"need their sizes \(linear\)"),
    ({"qkv_layout": "fused"}, "qkv layout 'fused' not one of"),
    ({"qkv_layout": "grouped", "attn_gate": True}, "gated attention needs the separate"),
    ({"rope_scaling": "dynamic", "rope_factor": 2.0}, "needs max_positions"),
])
def test_spec_refuses_what_the_decoder_cannot_build(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **change)


def test_unexpected_decoder_weights_are_refused_by_name() -> None:
    m = random_decoder(BASE)
    sd = {weight_key(n): t for n, t in m.state_dict().items()}
    extra = "language_model.layers.0.self_attn.wqkv.weight"
    with pytest.raises(KeyError, match=rf"does not expect: \['{extra}'\] \(1 unexpected\)"):
        TextDecoder(BASE).load_hf({**sd, extra: torch.zeros(3)})
    other = TextDecoder(BASE)  # a saved rotary buffer is known to be harmless
    other.load_hf({**sd, "language_model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(),
                                                 m.state_dict().values()))


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tmp_path: Path) -> None:
    """The InternVL family used to load the first layers of such a checkpoint silently."""
    m = Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))
    cfg = json.loads((m / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] -= 1
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"does not expect: \['language_model\.layers\.3\."):
        load_model(m)


def test_a_tied_checkpoint_may_carry_its_head(tmp_path: Path) -> None:
    """A tied model whose file also holds ``lm_head.weight`` (some writers save it) loads,
    the head staying the embeddings, as transformers ties it."""
    m = Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))
    sd = load_file(str(m / "model.safetensors"))
    sd["language_model.lm_head.weight"] = torch.zeros_like(
        sd["language_model.model.embed_tokens.weight"])
    save_file(sd, str(m / "model.safetensors"))
    llm = load_model(m).llm
    assert llm.lm_head.weight is llm.embed_tokens.weight
    assert llm.embed_tokens.weight.abs().max() > 0


@pytest.mark.parametrize("path", [DEFAULT_MODEL, DEFAULT_QWEN_MODEL], ids=["internvl", "qwen"])
def test_one_weight_naming_for_every_family(path: Path) -> None:
    """Every decoder-layer parameter's ``llm_key`` is a weight of the (normalised) checkpoint
    and ``llm_param`` maps it back: the default mapping, no family overrides it."""
    family, _ = family_for(path)
    assert "llm_param" not in type(family).__dict__ and "llm_key" not in type(family).__dict__
    keys = {family.normalise_key(k) for k in raw_state_dict(path)}
    names = [n for n in load_model(path).llm.state_dict() if n.startswith("layers.")]
    assert {n.split(".")[2] for n in names} == {
        "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    for n in names:
        assert family.llm_key(n) in keys, n
        assert family.llm_param(family.llm_key(n)) == n


@pytest.mark.parametrize(("edit", "message"), [
    ({"num_key_value_heads": 3}, "4 query heads do not share 3 kv heads"),
    ({"hidden_act": "swish"}, "unsupported activation 'swish'")])
def test_a_config_the_decoder_cannot_build_is_a_model_error(tmp_path: Path, edit: dict,
                                                            message: str) -> None:
    """Raised while reading the spec, naming the file, before any weight is read."""
    m = tmp_path / "model"
    m.mkdir()
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    cfg["text_config"].update(edit)
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=rf"config\.json: text_config: {message}"):
        read_spec(m)


@pytest.mark.parametrize("spec", [BASE, MROPE], ids=["1d", "mrope"])
def test_a_long_prefill_in_query_slices_equals_one_call(spec: TextSpec,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than ``QUERY_CHUNK`` attends in slices of that many queries (its
    scores never held whole, ``docs/reliability.md``): every hidden state and the cache equal
    one call's, after a cached past and with padded rows of other lengths (the slices cut
    through the mask's rows), within float32 rounding. With a slice's mask rows shifted by
    one (a fault injected once by hand), the hidden states differ by > 0.1."""
    m = random_decoder(spec)
    g = torch.Generator().manual_seed(2)
    x, past_x = torch.randn(2, 23, spec.hidden, generator=g), torch.randn(2, 6, spec.hidden,
                                                                          generator=g)
    lengths = torch.tensor([23, 17])
    with torch.no_grad():
        _, kv = m.prefill(past_x, torch.tensor([6, 6]), positions=positions(spec, 0, 6))
        want, want_kv = m.prefill_hidden(x, lengths, kv, positions=positions(spec, 6, 23))
        monkeypatch.setattr(decoder, "QUERY_CHUNK", 5)  # 23 queries: 5 slices, the last short
        got, got_kv = m.prefill_hidden(x, lengths, kv, positions=positions(spec, 6, 23))
    real = torch.arange(23)[None, :] < lengths[:, None]
    assert (got - want)[real].abs().max() <= 1e-5 and want.abs().max() > 1.0
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(got_kv, want_kv))
