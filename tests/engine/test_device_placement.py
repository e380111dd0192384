"""The model's forwards keep every tensor on the model's device, checked without a GPU.

PyTorch's ``meta`` device stands in for CUDA here: like CUDA, combining a meta tensor with a
CPU tensor that is not a 0-d scalar raises. So a tensor built inside a forward without
``device=`` (the classic bug that only shows on a GPU) fails these tests on the CPU. Meta
tensors have shapes but no values, so this checks placement and shapes, not numbers.
"""

from __future__ import annotations

import pytest
import torch

import vlmbatch.models.decoder
from vlmbatch.engine.loading import load_model

META = "meta"


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request: pytest.FixtureRequest):  # noqa: ANN201
    m = load_model(dtype=request.param)
    m.llm.to(META)
    m.vision.to(META)
    return m


def test_vision_encoder_on_the_model_device(model) -> None:  # noqa: ANN001
    s = model.spec.tiling.tile_size
    out = model.vision(torch.empty(3, s, s, 3, dtype=torch.uint8, device=META))
    assert out.device.type == META
    assert out.shape == (3, model.spec.tokens_per_tile, model.spec.text.hidden)


@pytest.mark.parametrize("expand", [False, True], ids=["enable_gqa", "expanded_kv"])
def test_prefill_and_decode_on_the_model_device(model, monkeypatch, expand: bool) -> None:  # noqa: ANN001
    monkeypatch.setattr(vlmbatch.models.decoder, "EXPAND_KV", expand)
    llm, t = model.llm, model.spec.text
    dtype = next(llm.parameters()).dtype
    emb = torch.empty(2, 7, t.hidden, device=META, dtype=dtype)
    lengths = torch.tensor([7, 5], device=META)
    logits, kv = llm.prefill(emb, lengths)
    assert logits.shape == (2, t.vocab) and logits.device.type == META
    assert kv[0][0].shape == (2, t.kv_heads, 7, t.head_dim)

    past = [(torch.empty(2, t.kv_heads, 4, t.head_dim, device=META, dtype=dtype),) * 2
            for _ in kv]  # a cached prefix of up to 4 tokens
    logits, new = llm.prefill(emb, lengths, past, torch.tensor([4, 3], device=META))
    assert logits.shape == (2, t.vocab)

    keys = [(torch.cat([pk, nk], 2), torch.cat([pv, nv], 2))
            for (pk, pv), (nk, nv) in zip(past, new)]
    step, _ = llm.decode_step(torch.empty(2, 1, t.hidden, device=META, dtype=dtype),
                              torch.tensor([11, 8], device=META), keys,
                              torch.ones(2, 11, dtype=torch.bool, device=META))
    assert step.shape == (2, t.vocab) and step.device.type == META


def test_a_cpu_tensor_in_a_forward_is_caught() -> None:
    """The premise: meta refuses to mix with CPU tensors, as CUDA does."""
    with pytest.raises(RuntimeError, match="device"):
        torch.empty(3, device=META) + torch.arange(3)
