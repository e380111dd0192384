"""capture_hazards finds host work in a forward on the CPU; what the pool captures has none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.conftest import make_model_dir
from vlmbatch.cudagraph_pool.hazards import capture_hazards
from vlmbatch.engine.loading import load_model
from vlmbatch.models.internvl.vision import VisionEncoder

HAZARDS = {
    "torch.tensor": (lambda t: t * torch.tensor([2.0]), "host data"),
    "item": (lambda t: t * t.sum().item(), "host reads"),
    "int": (lambda t: t[: int(t.argmax())], "host reads"),
    "bool": (lambda t: t if bool(t.sum() > 0) else -t, "truth value"),
    "bool mask": (lambda t: t[t > 0], "boolean-mask"),
    "nonzero": (torch.nonzero, "nonzero"),
    "masked_select": (lambda t: t.masked_select(t > 0), "masked_select"),
    "unique": (torch.unique, "unique"),
}


@pytest.mark.parametrize("name", sorted(HAZARDS))
def test_each_hazard_is_named(name: str) -> None:
    fn, why = HAZARDS[name]
    found = capture_hazards(fn, torch.randn(16))
    assert found and why in found[0], found


def test_capturable_ops_pass() -> None:
    w = torch.randn(8, 8)
    idx = torch.arange(4)  # built outside: fine

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(t @ w)[:, :4] + torch.zeros(1)
        return torch.cat([y.index_select(1, idx), y.new_zeros(y.shape[0], 1)], 1).softmax(-1)

    assert capture_hazards(fn, torch.randn(3, 8)) == []


def test_only_the_second_call_counts() -> None:
    """One-time set-up in the first call (the pool's warm-up) is not a hazard."""
    cache: dict[str, torch.Tensor] = {}

    def fn(t: torch.Tensor) -> torch.Tensor:
        if "k" not in cache:
            cache["k"] = torch.tensor([3.0])
        return t * cache["k"]

    assert capture_hazards(fn, torch.randn(4)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builtin_vision_encoder_is_capturable(dtype: torch.dtype) -> None:
    m = load_model(dtype=dtype)
    s = m.spec.tiling.tile_size
    tiles = torch.randint(0, 256, (3, s, s, 3), dtype=torch.uint8)
    assert capture_hazards(m.vision, tiles) == []


@pytest.mark.parametrize("variant", [{}, {"norm_type": "rms_norm", "qk_norm": True,
                                          "mean_pooling": False}])
def test_encoder_variants_are_capturable(tmp_path: Path, variant: dict) -> None:
    m = load_model(make_model_dir(tmp_path / "m", **variant))
    tiles = torch.randint(0, 256, (2, 56, 56, 3), dtype=torch.uint8)
    assert capture_hazards(m.vision, tiles) == []


def test_resized_positions_are_capturable(random_model_dir: Path) -> None:
    """A tile size other than the trained one (bicubic position resize) as well."""
    spec = load_model(random_model_dir).spec.vision
    enc = VisionEncoder(replace(spec, image_size=28)).eval()
    tiles = torch.randint(0, 256, (2, 56, 56, 3), dtype=torch.uint8)
    assert capture_hazards(enc, tiles) == []
