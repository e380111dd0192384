"""Our Qwen2-VL resize grid equals transformers' Qwen2-VL image processor (no download)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as ref

from vlmbatch.preprocessing.qwen2vl import llm_tokens, smart_resize

SIZES = [(480, 320), (480, 360), (612, 464), (896, 1344), (1920, 1080), (4000, 3000), (64, 64),
         (100, 2000), (28, 28), (10, 10), (1, 150), (3000, 20), (1023, 769), (56, 56 * 199)]


@pytest.mark.parametrize("w,h", SIZES)
@pytest.mark.parametrize("min_px,max_px", [(56 * 56, 14 * 14 * 4 * 1280), (256 * 28 * 28,
                                                                           1280 * 28 * 28)])
def test_grid_matches_transformers_function(w: int, h: int, min_px: int, max_px: int) -> None:
    ours = smart_resize(h, w, 28, min_px, max_px)
    assert ours == ref.smart_resize(h, w, 28, min_px, max_px)
    assert ours[0] % 28 == 0 and ours[1] % 28 == 0


@pytest.mark.parametrize("w,h", [(480, 320), (612, 464), (100, 300), (1920, 1080)])
def test_token_count_matches_image_processor(w: int, h: int) -> None:
    proc = ref.Qwen2VLImageProcessorPil()
    img = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    t, gh, gw = proc(images=[img], return_tensors="np")["image_grid_thw"][0]
    rh, rw = smart_resize(h, w, 28, proc.size["shortest_edge"], proc.size["longest_edge"])
    assert (t, gh, gw) == (1, rh // 14, rw // 14)
    assert llm_tokens(rh, rw) == gh * gw // 4


def test_rejects_extreme_aspect() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500)
