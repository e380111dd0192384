"""Our SDPA InternViT + projector equals transformers' get_image_features (fp32, random weights);
the comparison catches an injected attention bug and a fixture parameter left at its constant."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import InternVLForConditionalGeneration

from tests.conftest import make_model_dir, reference_pixels
from tests.models.fault_injection import FAULTS, constant_init_parameters, with_fault
from vlmbatch.engine.loading import load_model

TOL = 1e-5  # relative: max |ours - reference| / max |reference|

VARIANTS = {
    "layernorm": {},
    "rmsnorm_qknorm_final_norm": {"norm_type": "rms_norm", "qk_norm": True,
                                  "mean_pooling": False},
    "tile42_patch7": {"tile": 42, "patch": 7},
    "no_attention_bias": {"attention_bias": False},  # q/k/v biases absent: zero-filled
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
    rel = rel_err(got, want)
    assert rel <= TOL, f"relative error {rel:.2e}"


@pytest.fixture(scope="module")
def default_pair(random_model_dir: Path):  # noqa: ANN201
    """The shared fixture's model (q/k/v biases in the tower), ours and transformers', and
    three random tiles with the reference's features for them."""
    ours = load_model(random_model_dir)
    ref = InternVLForConditionalGeneration.from_pretrained(str(random_model_dir)).eval()
    tile = ours.spec.tiling.tile_size
    g = torch.Generator().manual_seed(3)
    tiles = torch.randint(0, 256, (3, tile, tile, 3), dtype=torch.uint8, generator=g)
    with torch.no_grad():
        want = ref.model.get_image_features(pixel_values=reference_pixels(tiles)).pooler_output
    return ours, tiles, want


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_vision_fault_is_caught(default_pair, fault: str) -> None:  # noqa: ANN001
    """Our tower with a bug injected misses the reference by > 100x the tolerance.
    Measured relative error: no q/k/v biases 0.016, query heads 0 and 1 swapped in layer 0
    0.012 (the former fixture, no q/k/v biases and 0.02 init: 3e-7 and 8e-5)."""
    ours, tiles, want = default_pair
    with torch.no_grad():
        got = with_fault(ours.vision, FAULTS[fault])(tiles)
    assert rel_err(got, want) > 100 * TOL


def test_every_constant_initialised_vision_parameter_matters(default_pair) -> None:  # noqa: ANN001
    """Each tower and projector parameter that transformers initialises to a constant
    (biases, norm weights, layer scales 0.5, class token and position table 0) is moved off
    it far enough that putting it back moves the output by > 10x the tolerance (measured:
    8.6e-4 for the least, a q bias). Not the k biases: a key bias adds the same q . b to
    every key's score of a query, which softmax removes (measured 1.7e-7)."""
    ours, tiles, _ = default_pair
    vision = copy.deepcopy(ours.vision)
    with torch.no_grad():
        base = vision(tiles)
    small = {}
    for name, t, value in constant_init_parameters(vision, layer_scale=0.5):
        if name.endswith("k_proj.bias"):
            continue
        keep = t.detach().clone()
        with torch.no_grad():
            t.fill_(value)
            moved = rel_err(vision(tiles), base)
            t.copy_(keep)
        if moved <= 10 * TOL:
            small[name] = moved
    assert not small, small


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

    from vlmbatch.engine.loading import read_spec

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        return read_spec(Path(tmp))[1].vision
