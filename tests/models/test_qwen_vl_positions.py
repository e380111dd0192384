"""M-RoPE positions vs transformers' ``get_rope_index`` (one image per prompt)."""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import Pair
from tests.models.qwen_vl_helpers import IMAGE, prompt_ids
from vlmbatch.models.qwen_vl.positions import batch_positions, image_positions, prompt_positions

GRIDS = [(1, 2, 2), (1, 4, 6), (1, 10, 4), (1, 16, 2), (1, 6, 14), (1, 2, 30)]
LENGTHS = [(1, 1), (4, 1), (9, 5), (2, 12)]  # (text before incl. start, after incl. end)


def reference(pair: Pair, ids: list[int], grid: tuple) -> tuple[torch.Tensor, int]:
    x = torch.tensor([ids])
    pos, delta = pair.ref.model.get_rope_index(
        x, mm_token_type_ids=(x == IMAGE).int(), image_grid_thw=torch.tensor([grid]))
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("before,after", LENGTHS)
def test_matches_get_rope_index(pair: Pair, grid: tuple, before: int, after: int) -> None:
    n = grid[1] * grid[2] // 4
    ids = prompt_ids(before, n, after)
    got, delta = prompt_positions(ids, IMAGE, grid, 2)
    want, want_delta = reference(pair, ids, grid)
    assert torch.equal(got, want)
    assert delta == want_delta


def test_layout() -> None:
    """Text 0..s-1; image t = s, h = s + row, w = s + col; text after from max + 1."""
    pos = image_positions(3, (1, 4, 6), 2)  # 2 x 3 units
    assert pos.tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    ids = [7, 8, 9, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 1, 2]
    full, delta = prompt_positions(ids, IMAGE, (1, 4, 6), 2)
    assert full[:, -2:].tolist() == [[6, 7]] * 3
    assert delta == 8 - len(ids)
    prefix, _ = prompt_positions(ids[:10], IMAGE, (1, 4, 6), 2)
    assert torch.equal(prefix, full[:, :10])  # a cached prefix keeps its positions


def test_text_only_and_errors() -> None:
    pos, delta = prompt_positions([5, 6, 7], IMAGE, None, 2)
    assert pos.tolist() == [[0, 1, 2]] * 3 and delta == 0
    with pytest.raises(ValueError, match="one contiguous run of 6"):
        prompt_positions([1, IMAGE, IMAGE, 2], IMAGE, (1, 4, 6), 2)
    with pytest.raises(ValueError, match="one contiguous run"):
        prompt_positions([1, IMAGE, 2, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE], IMAGE, (1, 4, 6), 2)
    with pytest.raises(ValueError, match="still images"):
        image_positions(0, (2, 4, 4), 2)
    with pytest.raises(ValueError, match="no grid_thw"):
        prompt_positions([IMAGE], IMAGE, None, 2)


def test_batch_positions_right_pads() -> None:
    a, _ = prompt_positions([1, 2, 3], IMAGE, None, 2)
    b, _ = prompt_positions([1, IMAGE, 2], IMAGE, (1, 2, 2), 2)
    out = batch_positions([a, b[:, :2]])
    assert out.shape == (3, 2, 3)
    assert out[:, 1].tolist() == [[0, 1, 0], [0, 1, 0], [0, 1, 0]]
