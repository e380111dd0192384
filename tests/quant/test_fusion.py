"""Fused projections on quantised models (``load_model(fuse=True)``, what the engine loads):
the fusion runs before the conversion, which then converts each fused linear whole. A W4A16
checkpoint's q/k/v (gate/up) int4 rows and group scales concatenated, FP8's row-wise scales
kept per row: the same layers side by side, so the same outputs as the separate linears.
torch's dynamic int8 linears keep one scale per tensor: not fused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.models.qwen_vl_helpers import rel_err
from tests.quant.test_quantize import EXAMPLES
from vlmbatch.cli.quantize import quantize_model
from vlmbatch.engine.loading import load_model
from vlmbatch.models.base import LoadedModel
from vlmbatch.models.io import raw_state_dict
from vlmbatch.quant.checkpoint import check_config, int4_weights
from vlmbatch.quant.fp8 import Fp8Linear
from vlmbatch.quant.int4 import Int4Linear
from vlmbatch.quant.runtime import convert_for_runtime

TOL = 1e-6


def logits(model: LoadedModel) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, model.llm.spec.hidden, generator=g)
    with torch.no_grad():
        return model.llm.prefill(x, torch.tensor([11, 7, 2]))[0]


@pytest.fixture(scope="module")
def int4_dir(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_model(random_model_dir, tmp_path_factory.mktemp("q") / "rtn", "rtn",
                          EXAMPLES, samples=4, group_size=32, progress=False).out


def test_int4_checkpoint_fused_at_load_equals_its_parts(int4_dir: Path) -> None:
    apart, fused = load_model(int4_dir), load_model(int4_dir, fuse=True)
    layer = fused.llm.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear)
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear)
    assert layer.self_attn.qkv_proj.kernel == apart.llm.layers[0].self_attn.q_proj.kernel
    assert rel_err(logits(fused), logits(apart)) <= TOL


def test_a_partly_quantised_group_is_split_back(int4_dir: Path,
                                                random_model_dir: Path) -> None:
    """A checkpoint with q and v quantised but not k (as another tool might write): that
    layer's q/k/v go back to three linears, two of them int4; the outputs those of the
    same conversion without fusion."""
    group = check_config(json.loads((int4_dir / "config.json").read_text())
                         ["quantization_config"])
    fused, apart = load_model(random_model_dir, fuse=True), load_model(random_model_dir)
    sd = {fused.family.normalise_key(k): t for k, t in raw_state_dict(int4_dir).items()}
    int4 = int4_weights(sd, group)
    del int4["language_model.layers.0.self_attn.k_proj.weight"]
    for m in (fused, apart):
        convert_for_runtime(m.llm, int4, group, "cpu", torch.float32, m.family.llm_param)
    attn = fused.llm.layers[0].self_attn
    assert not attn.fused and isinstance(attn.q_proj, Int4Linear)
    assert type(attn.k_proj) is nn.Linear and isinstance(attn.v_proj, Int4Linear)
    assert isinstance(fused.llm.layers[1].self_attn.qkv_proj, Int4Linear)
    assert rel_err(logits(fused), logits(apart)) <= TOL


def test_fp8_fused_at_load_equals_its_parts() -> None:
    apart = load_model(None, quant="fp8")
    fused = load_model(None, quant="fp8", fuse=True)
    assert isinstance(fused.llm.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert isinstance(fused.vision.layers[0].qkv_proj, Fp8Linear)
    assert rel_err(logits(fused), logits(apart)) <= TOL


def test_fp8_cat_is_the_layer_of_the_concatenated_weights() -> None:
    """Row-wise scales: joining converted parts gives the bits and scales that converting
    the joined weight gives, the padded backend's zero rows included."""
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(n, 40, generator=g) for n in (24, 8, 8)]
    bs = [torch.randn(n, generator=g) for n in (24, 8, 8)]
    for backend in ("reference", "scaled_mm"):
        joined = Fp8Linear.cat([Fp8Linear(w, b, backend) for w, b in zip(ws, bs)])
        want = Fp8Linear(torch.cat(ws), torch.cat(bs), backend)
        assert joined is not None and joined.out_features == 40
        for name in ("weight_bits", "scale_bits", "bias"):
            assert torch.equal(getattr(joined, name), getattr(want, name)), (backend, name)
    assert Fp8Linear.cat([Fp8Linear(ws[0], None, "reference"),
                          Fp8Linear(ws[1], bs[1], "reference")]) is None


def test_int8_dynamic_is_not_fused() -> None:
    m = load_model(None, llm_quant="int8-dynamic", fuse=True)
    attn = m.llm.layers[0].self_attn
    assert not attn.fused and hasattr(attn, "q_proj")
