"""Our Qwen-VL vision towers vs transformers' ``model.visual`` (fp32, CPU, random weights); the
comparison catches an injected attention bug and a fixture parameter left at its constant."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from tests.models.conftest import Pair
from tests.models.fault_injection import FAULTS, constant_init_parameters, with_fault
from tests.models.qwen_vl_helpers import reference_pixels, rel_err
from vlmbatch.models.base import VisionOutput
from vlmbatch.models.qwen_vl.vision import VisionTower

# (t, h, w) in patches: several sizes and aspect ratios, a ragged Qwen2.5-VL window edge
# (h/2 or w/2 odd), one image of a single merge window
GRIDS = [(1, 4, 6), (1, 10, 4), (1, 2, 2), (1, 8, 12), (1, 14, 2)]
TOL = 1e-5  # relative: max |ours - reference| / max |reference|


def patches(pair: Pair, grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, pair.ours.spec.vision.row_size), generator=g,
                         dtype=torch.uint8)


def reference(pair: Pair, x: torch.Tensor, grids: list) -> tuple[torch.Tensor, list]:
    v = pair.ours.spec.vision
    with torch.no_grad():
        out = pair.ref.model.visual(reference_pixels(x, v.mean, v.std),
                                    grid_thw=torch.tensor(grids))
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def test_batch_matches_transformers(pair: Pair) -> None:
    x = patches(pair, GRIDS)
    want, want_deep = reference(pair, x, GRIDS)
    with torch.no_grad():
        got = pair.ours.vision(x, GRIDS)
    assert got.embeds.shape == want.shape == (x.shape[0] // 4, pair.ours.spec.text.hidden)
    assert rel_err(got.embeds, want) <= TOL
    assert len(got.deepstack) == len(want_deep) == len(pair.ours.spec.vision.deepstack)
    for a, b in zip(got.deepstack, want_deep):
        assert rel_err(a, b) <= TOL


def worst_err(got: VisionOutput, want: tuple[torch.Tensor, list]) -> float:
    """The largest relative error over the embeddings and each DeepStack feature."""
    return max(rel_err(a, b) for a, b in zip((got.embeds, *got.deepstack),
                                             (want[0], *want[1]), strict=True))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_vision_fault_is_caught(pair: Pair, fault: str) -> None:
    """Our tower with a bug injected misses the reference by > 100x the tolerance.
    Measured relative error, the worst output (no qkv biases; query heads 0 and 1 swapped
    in block 0): Qwen2-VL 0.028, 0.023; Qwen2.5-VL 0.023, 0.020; Qwen3-VL 0.052, 0.026
    (our tower as loaded: 7e-7 to 1e-6)."""
    x = patches(pair, GRIDS)
    want = reference(pair, x, GRIDS)
    with torch.no_grad():
        got = with_fault(pair.ours.vision, FAULTS[fault])(x, GRIDS)
    assert worst_err(got, want) > 100 * TOL


def test_every_constant_initialised_vision_parameter_matters(pair: Pair) -> None:
    """Each tower parameter transformers initialises to a constant (biases, norm weights
    and shifts), DeepStack mergers' included, is moved off it far enough that putting it
    back moves the output by > 10x the tolerance (measured: 2.5e-3 for the least, a norm
    weight)."""
    x = patches(pair, GRIDS, seed=2)
    vision = copy.deepcopy(pair.ours.vision)
    small = {}
    with torch.no_grad():
        out = vision(x, GRIDS)
        base = (out.embeds, list(out.deepstack))
        for name, t, value in constant_init_parameters(vision, layer_scale=1.0):
            keep = t.clone()
            t.fill_(value)
            moved = worst_err(vision(x, GRIDS), base)
            t.copy_(keep)
            if moved <= 10 * TOL:
                small[name] = moved
    assert not small, small


def test_batch_equals_one_image_at_a_time(pair: Pair) -> None:
    """Attention stays inside each image: a batch is the images' outputs concatenated."""
    x = patches(pair, GRIDS, seed=1)
    with torch.no_grad():
        batch = pair.ours.vision(x, GRIDS)
        alone, start = [], 0
        for g in GRIDS:
            n = g[0] * g[1] * g[2]
            alone.append(pair.ours.vision(x[start: start + n], [g]))
            start += n
    assert rel_err(batch.embeds, torch.cat([a.embeds for a in alone])) <= TOL
    for i, feat in enumerate(batch.deepstack):
        assert rel_err(feat, torch.cat([a.deepstack[i] for a in alone])) <= TOL


def test_window_attention_is_exercised(pairs: dict[str, Pair]) -> None:
    """Negative control: the same Qwen2.5-VL weights without windows give other outputs, so
    the parity above depends on the window layout being right."""
    pair = pairs["qwen2_5_vl"]
    full = VisionTower(dataclasses.replace(pair.ours.spec.vision, window=0)).eval()
    full.load_hf(load_file(str(pair.path / "model.safetensors")))
    x = patches(pair, GRIDS)
    with torch.no_grad():
        assert rel_err(full(x, GRIDS).embeds, pair.ours.vision(x, GRIDS).embeds) > 1e-2


def test_loads_both_key_prefixes(pair: Pair) -> None:
    """``visual.*`` (Qwen2/2.5-VL as saved) and ``model.visual.*`` (Qwen3-VL, newer saves)."""
    sd = load_file(str(pair.path / "model.safetensors"))
    flip = {("model.visual." + k[len("visual."):] if k.startswith("visual.")
             else k.replace("model.visual.", "visual.", 1)): t for k, t in sd.items()}
    other = VisionTower(pair.ours.spec.vision).eval()
    other.load_hf(flip)
    x = patches(pair, GRIDS[:2])
    with torch.no_grad():
        assert torch.equal(other(x, GRIDS[:2]).embeds, pair.ours.vision(x, GRIDS[:2]).embeds)
    missing = {k: t for k, t in sd.items() if "blocks.1.attn.qkv.weight" not in k}
    with pytest.raises(KeyError, match="blocks.1.attn.qkv.weight"):
        VisionTower(pair.ours.spec.vision).load_hf(missing)


def test_rejects_rows_that_do_not_fit_the_grids(pair: Pair) -> None:
    x = patches(pair, GRIDS[:1])
    with pytest.raises(ValueError, match="do not fit"):
        pair.ours.vision(x[:-4], GRIDS[:1])
    with pytest.raises(ValueError, match="multiples"):
        pair.ours.vision(x, [(1, 3, 8)])
