"""Our SDPA InternViT + projector equals transformers' get_image_features (fp32, random weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import InternVLForConditionalGeneration

from tests.conftest import make_model_dir, reference_pixels
from vlmbatch.pipeline.loading import load_model

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


def test_internvit_300m_shape() -> None:
    """The real InternViT-300M shape (24 layers, hidden 1024, 16 heads, 448 px, patch 14),
    random weights, one tile: ours equals transformers. About a minute on 2 CPU cores."""
    from transformers import InternVLConfig

    from vlmbatch.models.internvl.family import InternVL
    from vlmbatch.models.internvl.vision import VisionEncoder

    normalise_key = InternVL().normalise_key

    cfg = InternVLConfig(
        vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                           intermediate_size=4096, image_size=448, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=64, hidden_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64),
        image_seq_length=256)
    torch.manual_seed(0)
    ref = InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "position_embeddings" in name or "cls_token" in name:
                p.normal_(0, 0.5)
    spec = read_spec_from_config(cfg.to_dict())
    ours = VisionEncoder(spec).eval()
    ours.load_hf({normalise_key(k): v for k, v in ref.state_dict().items()})
    tiles = torch.randint(0, 256, (1, 448, 448, 3), dtype=torch.uint8)
    with torch.no_grad():
        got = ours(tiles)
        want = ref.model.get_image_features(pixel_values=reference_pixels(tiles)).pooler_output
    assert got.shape == want.shape == (1, 256, 64)
    assert (got - want).abs().max() / want.abs().max() <= 1e-5


def read_spec_from_config(cfg: dict):  # noqa: ANN201
    """The VisionSpec ``read_spec`` builds from a config.json holding ``cfg``."""
    import json
    import tempfile

    from vlmbatch.pipeline.loading import read_spec

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        return read_spec(Path(tmp))[1].vision
