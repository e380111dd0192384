"""Our SDPA InternViT + projector equals transformers' get_image_features (fp32, random weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import InternVLForConditionalGeneration

from pipeline.model import load_model
from tests.conftest import make_model_dir, reference_pixels

VARIANTS = {
    "layernorm": {},
    "rmsnorm_qknorm_final_norm": {"norm_type": "rms_norm", "qk_norm": True,
                                  "mean_pooling": False},
    "tile42_patch7": {"tile": 42, "patch": 7},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    path = make_model_dir(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    ours = load_model(path)
    ref = InternVLForConditionalGeneration.from_pretrained(str(path)).eval()
    return ours, ref


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_vision_matches_transformers(pair, batch: int) -> None:  # noqa: ANN001
    ours, ref = pair
    tile = ours.spec.tiling.tile_size
    g = torch.Generator().manual_seed(batch)
    tiles = torch.randint(0, 256, (batch, tile, tile, 3), dtype=torch.uint8, generator=g)
    with torch.no_grad():
        got = ours.vision(tiles)
        want = ref.model.get_image_features(pixel_values=reference_pixels(tiles)).pooler_output
    assert got.shape == want.shape == (batch, ours.spec.tokens_per_tile, ours.spec.text.hidden)
    rel = (got - want).abs().max() / want.abs().max()
    assert rel <= 1e-5, f"relative error {rel:.2e}"


def test_position_embedding_interpolation(tmp_path: Path) -> None:
    """A tile larger than the trained size interpolates positions as transformers does."""
    path = make_model_dir(tmp_path / "m", tile=56)
    ours = load_model(path)
    ref = InternVLForConditionalGeneration.from_pretrained(str(path)).eval()
    tiles = torch.randint(0, 256, (2, 112, 112, 3), dtype=torch.uint8)
    with torch.no_grad():
        got = ours.vision(tiles)
        want = ref.model.get_image_features(pixel_values=reference_pixels(tiles)).pooler_output
    assert got.shape == want.shape
    assert (got - want).abs().max() / want.abs().max() <= 1e-5
