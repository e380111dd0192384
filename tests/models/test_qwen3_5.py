"""Qwen3.5 beyond the shared Qwen-VL reference tests (``test_qwen_vl_reference.py`` runs
those on the tiny Qwen3.5 too): the gated delta rule's two forms against each other and
against transformers' own functions, a text-only prompt against transformers, the config
reader's Qwen3.5 fields and refusals, and the prompts' no-thinking switch.

Tolerances: the delta rule forms 1e-5 (float32, O(1) outputs), logits abs 1e-4."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.conftest import Pair
from tests.models.qwen_vl_helpers import VOCAB
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.linear_attention import chunk_rule, delta_rule, l2norm, recurrent_rule
from vlmbatch.models.qwen_vl.prompt import QwenVLPrompts
from vlmbatch.models.qwen_vl.spec import SpecError, spec_from_config
from vlmbatch.models.qwen_vl.tokenizer import build_tokenizer
from vlmbatch.models.registry import family_for


def rule_inputs(b: int, h: int, t: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    """q, k (normalised, q scaled), v, g (log decays in [-0.3, 0)), beta, state: heads first."""
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, h, t, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(b, h, t, dk, generator=g))
    v = torch.randn(b, h, t, dv, generator=g)
    decay = -0.3 * torch.rand(b, h, t, generator=g)
    beta = torch.rand(b, h, t, generator=g)
    return [q, k, v, decay, beta, torch.randn(b, h, dk, dv, generator=g)]


@pytest.mark.parametrize("t,chunk", [(1, 16), (15, 16), (16, 16), (50, 16), (130, 64)])
def test_chunked_rule_equals_recurrent(t: int, chunk: int) -> None:
    """The chunked form (padded to whole chunks) = token by token, outputs and final state,
    from a non-zero initial state."""
    args = rule_inputs(2, 3, t, 8, 12, seed=t)
    o1, s1 = recurrent_rule(*args)
    o2, s2 = chunk_rule(*args, chunk=chunk)
    assert o2.shape == o1.shape == (2, 3, t, 12)
    assert (o1 - o2).abs().max() <= 1e-5 and (s1 - s2).abs().max() <= 1e-5
    # a control: the initial state matters at this decay
    o3, _ = recurrent_rule(*args[:5], torch.zeros_like(args[5]))
    assert (o3 - o1).abs().max() > 1e-2


def test_delta_rule_equals_transformers_functions() -> None:
    """Our ``delta_rule`` (grouped value heads, normalisation inside) = transformers'
    ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` on the same
    raw inputs (2 key heads serving 4 value heads)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 90, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 90, 4, 12, generator=g)
    decay, beta = -0.2 * torch.rand(2, 90, 4, generator=g), torch.rand(2, 90, 4, generator=g)
    state = torch.randn(2, 4, 8, 12, generator=g)
    o, s = delta_rule(q, k, v, decay, beta, state)
    for fn in (ref.torch_chunk_gated_delta_rule, ref.torch_recurrent_gated_delta_rule):
        want_o, want_s = fn(q, k, v, g=decay, beta=beta, initial_state=state,
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (o - want_o).abs().max() <= 1e-5 and (s - want_s).abs().max() <= 1e-5
    one, s1 = delta_rule(q[:, :1], k[:, :1], v[:, :1], decay[:, :1], beta[:, :1], state)
    assert (one - o[:, :1]).abs().max() <= 1e-5  # the recurrent form (decode) agrees


def test_text_only_logits_match_transformers(pairs: dict[str, Pair]) -> None:
    """A prompt with no image: M-RoPE positions are the index on every axis."""
    pair = pairs["qwen3_5"]
    ids = torch.randint(1, 300, (1, 140), generator=torch.Generator().manual_seed(3))
    text = pair.ours.text
    with torch.no_grad():
        want = pair.ref(input_ids=ids).logits[0, -1]
        got, _ = text.prefill(text.embed_tokens(ids), torch.tensor([140]),
                              positions=torch.arange(140).expand(3, 1, 140))
    assert (got[0] - want).abs().max() <= 1e-4


def test_spec_defaults_and_fields() -> None:
    """A minimal qwen3_5 config takes transformers' defaults: three linear layers then one
    full, head dim 256 with a quarter rotary (64 channels: sections (11, 11, 10)), linear
    attention 16 key heads serving 32 value heads of 128, conv kernel 4."""
    cfg = {"model_type": "qwen3_5", "text_config": {
        "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2},
        "vision_config": {"out_hidden_size": 256}}
    s = spec_from_config(cfg)
    t = s.text
    assert t.kinds == ("linear",) * 3 + ("full",) + ("linear",) * 3 + ("full",)
    assert (t.head_dim, t.rope_dim, t.mrope_section, t.rope) == (256, 64, (11, 11, 10),
                                                                 "mrope-interleaved")
    assert t.linear is not None and (t.linear.key_heads, t.linear.value_heads,
                                     t.linear.key_dim, t.linear.value_dim,
                                     t.linear.conv_kernel) == (16, 32, 128, 128, 4)
    assert t.attn_gate and t.centered_norm and t.qk_norm and not t.qkv_bias
    assert s.vision.kind == "qwen3_vl" and s.vision.deepstack == ()
    interval = dict(cfg, text_config=dict(cfg["text_config"], full_attention_interval=2))
    assert spec_from_config(interval).text.kinds == ("linear", "full") * 4


def test_spec_refusals() -> None:
    base = {"model_type": "qwen3_5", "text_config": {
        "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}
    with pytest.raises(SpecError, match="qwen3_5_moe.*Qwen3.5 MoE.*not supported.*dense"):
        spec_from_config({"model_type": "qwen3_5_moe"})
    bad_types = dict(base, text_config=dict(base["text_config"],
                                            layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(SpecError, match="layer_types.*sliding_attention"):
        spec_from_config(bad_types)
    bad_heads = dict(base, text_config=dict(base["text_config"], linear_num_key_heads=3,
                                            linear_num_value_heads=4))
    with pytest.raises(SpecError, match="4 linear value heads do not share 3"):
        spec_from_config(bad_heads)
    bad_section = dict(base, text_config=dict(base["text_config"], rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "mrope_section": [24, 20, 20]}))
    with pytest.raises(SpecError, match=r"mrope_section.*rotary pairs, 32"):
        spec_from_config(bad_section)


def test_registry_refuses_moe(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    with pytest.raises(ModelError, match="Qwen3.5 MoE.*not supported.*'qwen3_5'"):
        family_for(tmp_path)


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
            "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")


def test_prompts_ask_for_no_thinking(pairs: dict[str, Pair]) -> None:
    """Under a template with a thinking switch (Qwen3's form), the Qwen3.5 family's prompts
    end after an empty think block; the same template without the switch would leave the
    answer position inside ``<think>``."""
    tok = build_tokenizer(["yes no <think> </think>"], vocab_size=VOCAB - 20)
    tok.chat_template = THINKING
    ids = [tok.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")]
    off = QwenVLPrompts(tok, ids[0], ids[1], ids[2], 2, chat_kwargs={"enable_thinking": False})
    on = QwenVLPrompts(tok, ids[0], ids[1], ids[2], 2)
    assert tok.decode(off._tail).endswith("<think>\n\n</think>\n\n")
    assert tok.decode(on._tail).endswith("assistant\n<think>\n")
    family, cfg = family_for(pairs["qwen3_5"].path)
    spec = dataclasses.replace(family.read_spec(pairs["qwen3_5"].path, cfg),
                               image_token_id=ids[0], vision_start_id=ids[1],
                               vision_end_id=ids[2])
    assert family.prompt_builder(tok, spec)._tail == off._tail  # type: ignore[attr-defined]
