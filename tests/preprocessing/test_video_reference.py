"""``--resize reference`` on a clip's frames: the pixels of transformers' video processors.

transformers' video processors (``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``,
``InternVLVideoProcessor``) resize with torchvision (``BaseVideoProcessor`` has no Pillow
backend); they are run here themselves, on fresh random frames encoded losslessly, where
torchvision is on the path (``tests/conftest.py``; skipped otherwise, as the image processors'
tests are). The original InternVL layout's model card tiles each frame as an image
(``dynamic_preprocess`` with one tile: Pillow's bicubic), which runs everywhere. Our uint8
rows, normalised as the towers normalise them (``video_plan.normalise``), must be within
1e-6 of the processors' ``pixel_values_videos``; the default (OpenCV) is shown to miss that
bound, so the comparison can fail.
"""

from __future__ import annotations

import functools
import io
import sys
import zlib
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.preprocessing.video_clips import FFV1_MKV, make_clip
from vlmbatch.engine.loading import video_plan_for
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess
from vlmbatch.preprocessing.reference import pillow_tiles, pixel_values
from vlmbatch.preprocessing.resize import resize
from vlmbatch.preprocessing.video_plan import VideoPlan, normalise
from vlmbatch.preprocessing.video_rows import FrameTiles, QwenVideoLayout
from vlmbatch.preprocessing.video_sampling import VideoSampling

TOL = 1e-6
needs_tv = pytest.mark.skipif("torchvision" not in sys.modules, reason="needs torchvision on "
                              "the path (tests/conftest.py says how; never installed beside "
                              "our CPU torch)")
REFERENCE = functools.partial(resize, kernel="torchvision")  # what the run option sets
# (w, h) of the source frames: shrunk and enlarged by each family's size below
SIZES = [(130, 90), (37, 21), (301, 203)]


def clip_of(w: int, h: int, n: int, seed: int) -> tuple[np.ndarray, bytes]:
    px = np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    return px, make_clip(px, FFV1_MKV)


def processor(family: str) -> tuple[object, VideoPlan]:
    """transformers' video processor of ``family`` and our plan with the same sizes."""
    if family == "internvl":
        from transformers.models.internvl.video_processing_internvl import (
            InternVLVideoProcessor,
        )
        proc = InternVLVideoProcessor(size={"height": 64, "width": 64})
        return proc, VideoPlan(VideoSampling("internvl", fps=None, num_frames=4), FrameTiles(64),
                               mean=tuple(proc.image_mean), std=tuple(proc.image_std))
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import (
            Qwen2VLVideoProcessor as Cls,
        )
        q = QwenVLPreprocess(14, 2, 2, 56 * 56, 28 * 28 * 20)
    else:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor as Cls,  # type: ignore[assignment]
        )
        q = QwenVLPreprocess(16, 2, 2, 32 * 32 * 8, 32 * 32 * 40)
    proc = Cls(size={"shortest_edge": q.min_pixels, "longest_edge": q.max_pixels},
               patch_size=q.patch, merge_size=q.merge, temporal_patch_size=q.temporal)
    return proc, VideoPlan(VideoSampling(family, fps=None, num_frames=4),
                           QwenVideoLayout(q, clip_budget=family == "qwen3_vl"),
                           mean=tuple(proc.image_mean), std=tuple(proc.image_std))


@needs_tv
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "internvl"])
@pytest.mark.parametrize("size", SIZES)
def test_reference_frames_equal_the_video_processors(family: str, size: tuple) -> None:
    proc, plan = processor(family)
    px, data = clip_of(*size, n=4, seed=zlib.crc32(f"{family}{size}".encode()))
    want = proc(videos=[torch.from_numpy(px).permute(0, 3, 1, 2)], do_sample_frames=False,
                return_tensors="pt")["pixel_values_videos"].numpy()
    ours = normalise(replace(plan, resize=REFERENCE).prepare(data, 10**9).rows, plan)
    assert ours.size == want.size
    np.testing.assert_allclose(ours, want.reshape(ours.shape), rtol=0, atol=TOL)
    default = normalise(plan.prepare(data, 10**9).rows, plan)  # OpenCV's policy
    assert np.abs(default - want.reshape(ours.shape)).max() > 100 * TOL


def test_original_internvl_frames_equal_the_model_card() -> None:
    """The model card's ``load_video``: each frame ``dynamic_preprocess``-ed to one tile
    (Pillow bicubic), then ToTensor + Normalize (``preprocessing/reference.py``)."""
    tile = 48
    plan = VideoPlan(VideoSampling("internvl", fps=None, num_frames=3), FrameTiles(tile),
                     resize=functools.partial(resize, kernel="pillow"))
    for w, h in SIZES:
        px, data = clip_of(w, h, n=3, seed=w + h)
        pngs = []
        for f in px:
            buf = io.BytesIO()
            Image.fromarray(f).save(buf, format="PNG")
            pngs.append(buf.getvalue())
        want = torch.cat([pixel_values(pillow_tiles(b, tile, 1, 1), plan.mean, plan.std)
                          for b in pngs]).numpy()
        got = plan.prepare(data, 10**9)
        assert list(got.frame_indices) == [0, 1, 2]
        np.testing.assert_allclose(normalise(got.rows, plan), want, rtol=0, atol=TOL)


def test_the_resize_option_reaches_the_frames() -> None:
    """``video_plan_for`` takes the image plan's kernel (``--resize``): frames resized by it;
    OpenCV's (the default) leaves the plan's resize unset."""
    spec = SimpleNamespace(model_type="internvl", path=DEFAULT_MODEL, tokens_per_tile=16,
                           text=SimpleNamespace(max_positions=4096))
    assert video_plan_for(spec).resize is None  # type: ignore[arg-type, union-attr]
    for kernel in ("torchvision", "pillow"):
        plan = video_plan_for(spec, kernel)  # type: ignore[arg-type]
        assert plan is not None and plan.resize is not None
        img = np.random.default_rng(5).integers(0, 256, (30, 50, 3), dtype=np.uint8)
        np.testing.assert_array_equal(plan.resize(img, 20, 10), resize(img, 20, 10, kernel))
    import vlmbatch

    with vlmbatch.VLM(resize="reference", decode_timeout=0) as vlm:  # the built-in InternVL
        plan = vlm.engine.video_plan
        assert plan is not None and plan.resize is not None
        assert plan.resize.keywords == {"kernel": "torchvision"}  # the HF layout's processor
