"""Qwen-VL patches vs transformers' image processor (no download, no torchvision).

The reference is ``Qwen2VLImageProcessorPil``, built from its constructor: Qwen2-VL,
Qwen2.5-VL and Qwen3-VL all use this processor (``auto/image_processing_auto``), Qwen3-VL with
16 px patches and mean/std 0.5. The default ``Qwen2VLImageProcessor`` needs torchvision, which
is not installed here; the Pillow one resamples with PIL bicubic (ours: OpenCV INTER_AREA /
INTER_CUBIC), so resized pixels differ slightly, while grid, token count and patch order must
be exact.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess, patchify, prepare_qwen_vl

CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
CASES = {  # name: (our config, mean, std)
    "qwen2_vl": (QwenVLPreprocess(14, 2, 2, 56 * 56, 28 * 28 * 256), *CLIP),
    "qwen3_vl": (QwenVLPreprocess(16, 2, 2, 64 * 64, 32 * 32 * 200), (0.5,) * 3, (0.5,) * 3),
}
SIZES = [(480, 320), (612, 464), (100, 300), (1024, 768), (37, 53), (20, 900), (640, 64)]
# Measured over SIZES with photo(): mean |ours - reference| per image 0.004-0.009 in
# normalised units (0.3-0.6 grey levels of 255), the largest single value 0.38 (at the drawn
# shapes' hard edges). The bound leaves ~1.7x headroom on the worst image.
MEAN_ABS_TOL = 0.015


def reference(cfg: QwenVLPreprocess, mean: tuple, std: tuple) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch, merge_size=cfg.merge, temporal_patch_size=cfg.temporal,
        image_mean=list(mean), image_std=list(std), min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels)


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth colour field + texture + two hard-edged shapes + sensor noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, h // 24), max(2, w // 24), 3), dtype=np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC).astype(np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    img += 30 * (np.sin(xx / 7.0) * np.cos(yy / 11.0))[..., None]
    cv2.circle(img, (w // 3, h // 2), max(3, min(h, w) // 5), (250, 20, 40), -1)
    cv2.rectangle(img, (w // 2, h // 5), (w - w // 6, h // 2), (10, 200, 90), -1)
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def normalised(patches: np.ndarray, mean: tuple, std: tuple) -> np.ndarray:
    per = patches.shape[1] // 3
    m, s = np.repeat(mean, per), np.repeat(std, per)
    return (patches / 255.0 - m) / s


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("w,h", SIZES)
def test_grid_tokens_exact_pixels_close(name: str, w: int, h: int) -> None:
    cfg, mean, std = CASES[name]
    img = photo(h, w, seed=w)
    ours = prepare_qwen_vl(img, cfg)
    ref = reference(cfg, mean, std)(images=[img], return_tensors="np")
    assert ours.grid.thw == tuple(int(x) for x in ref["image_grid_thw"][0])
    assert ours.grid.tokens == ours.grid.h * ours.grid.w // 4 == cfg.tokens(h, w)
    want = ref["pixel_values"]
    assert ours.rows.dtype == np.uint8 and ours.rows.shape == want.shape
    assert np.abs(normalised(ours.rows, mean, std) - want).mean() <= MEAN_ABS_TOL


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("gh,gw", [(4, 4), (4, 6), (10, 4), (2, 16)])
def test_patch_order_exact_where_resize_is_identity(name: str, gh: int, gw: int) -> None:
    """At a size smart resize keeps, both sides see the same pixels: the reference's rows,
    un-normalised, are our uint8 rows exactly (any other order of the values would not be)."""
    cfg, mean, std = CASES[name]
    img = np.random.default_rng(gh * 100 + gw).integers(
        0, 256, (gh * cfg.patch, gw * cfg.patch, 3), dtype=np.uint8)
    assert cfg.target_size(*img.shape[:2]) == img.shape[:2]
    ours = prepare_qwen_vl(img, cfg)
    want = reference(cfg, mean, std)(images=[img], return_tensors="np")["pixel_values"]
    per = want.shape[1] // 3
    back = (want * np.repeat(std, per) + np.repeat(mean, per)) * 255.0
    assert np.abs(back - np.rint(back)).max() < 1e-3
    np.testing.assert_array_equal(np.rint(back).astype(np.uint8), ours.rows)


def test_rows_are_channel_major_with_the_frame_repeated() -> None:
    """A row is [c][t][py][px]; patches go merge window by merge window."""
    cfg = QwenVLPreprocess(14, 2, 2, 28 * 28, 28 * 28 * 4)
    img = np.zeros((56, 28, 3), dtype=np.uint8)
    img[14:28, 14:28] = (10, 20, 30)  # patch (row 1, col 1): 4th row of the 1st window
    rows = patchify(img, cfg)
    assert rows.shape == (8, 3 * 2 * 14 * 14)
    assert np.flatnonzero(rows.any(axis=1)).tolist() == [3]
    assert rows[3].reshape(3, 2, 14, 14)[:, :, 0, 0].tolist() == [[10, 10], [20, 20], [30, 30]]


def test_hash_identifies_pixels_and_grid() -> None:
    cfg = QwenVLPreprocess(14, 2, 2, 56 * 56, 28 * 28 * 64)
    a, b = photo(100, 140, 1), photo(100, 140, 2)
    pa, pb = prepare_qwen_vl(a, cfg), prepare_qwen_vl(b, cfg)
    assert pa.content_hash == prepare_qwen_vl(a.copy(), cfg).content_hash
    assert pa.content_hash != pb.content_hash
    small = QwenVLPreprocess(14, 2, 2, 56 * 56, 28 * 28 * 8)
    assert prepare_qwen_vl(a, small).cache_key != pa.cache_key


def test_rejects_non_rgb() -> None:
    cfg = QwenVLPreprocess()
    with pytest.raises(ValueError, match="uint8 RGB"):
        prepare_qwen_vl(np.zeros((30, 30), np.uint8), cfg)
    with pytest.raises(ValueError, match="multiples"):
        patchify(np.zeros((30, 28, 3), np.uint8), cfg)


@pytest.mark.parametrize("name", CASES)
def test_large_jpeg_is_decoded_reduced_to_what_the_resize_keeps(name: str) -> None:
    """Through ``need``: a 12 MP JPEG under a 256-token plan is decoded DCT-reduced (the
    resize keeps ~0.2 MP), planned on its full size, and gives the same grid and nearly the
    same rows as a full decode; under the checkpoint's own 12.8 MP cap it needs every pixel
    and is decoded whole."""
    import io

    from PIL import Image

    from vlmbatch.preprocessing.decode import decode, decode_for
    from vlmbatch.preprocessing.prepare import prepare_bytes

    buf = io.BytesIO()
    Image.fromarray(photo(3000, 4000, seed=3)).save(buf, "JPEG", quality=92)
    data = buf.getvalue()
    plan = CASES[name][0]
    for cfg, reduced in ((plan.with_max_tokens(256), True),
                         (QwenVLPreprocess(plan.patch, 2, 2, plan.min_pixels, 12845056), False)):
        img, full = decode_for(data, cfg.need, 10**9)
        assert (full is not None and img.shape[0] < 3000) == reduced
        fast, ref = prepare_bytes(data, cfg, 10**9), prepare_qwen_vl(decode(data), cfg)
        assert fast.grid == ref.grid and (fast.width, fast.height) == (4000, 3000)
        diff = np.abs(fast.rows.astype(np.int16) - ref.rows.astype(np.int16))
        # docs/qwen_vl.md: 0.66 / 0.68 grey levels apart on average (Qwen2/2.5-VL / Qwen3-VL)
        assert diff.mean() <= 0.75 and (diff.mean() == 0) == (not reduced)
