"""Frame indices (``preprocessing/video_sampling.py``) equal transformers' own video
processors' ``sample_frames`` (Qwen2-VL, Qwen3-VL, InternVL), called on the same metadata
over many clips and settings; a checkpoint's video settings are read from the file
transformers' ``from_pretrained`` reads. The processors' modules import torchvision, which
does not run beside our CPU torch: their methods are run from transformers' source text
(``transformers_source.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata

from tests.preprocessing.transformers_source import processor
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess
from vlmbatch.preprocessing.video_plan import checkpoint_video, read_video_config
from vlmbatch.preprocessing.video_rows import FrameTiles, QwenVideoLayout
from vlmbatch.preprocessing.video_sampling import (
    ClipInfo,
    SamplingError,
    VideoSampling,
    torch_arange_int,
)

QWEN2 = ("models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor")
QWEN3 = ("models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor")
INTERNVL = ("models.internvl.video_processing_internvl", "InternVLVideoProcessor")

FPS = st.sampled_from([1, 2, 0.5, 3.7, 8, 23.976, 24, 25, 29.97, 30, 50, 59.94, 60, 120])
clips = st.builds(lambda n, fps: ClipInfo(n, float(fps), n / float(fps)),
                  st.integers(1, 5000), FPS)
rates = st.one_of(st.none(), st.sampled_from([0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4, 7.5, 10, 30]))


def reference(processor: object, clip: ClipInfo, **kw: object) -> np.ndarray | type:
    """The processor's own indices, or the exception type it raises."""
    meta = VideoMetadata(total_num_frames=clip.total_frames, fps=clip.fps,
                         duration=clip.duration)
    try:
        got = processor.sample_frames(meta, **kw)  # type: ignore[attr-defined]
    except (ValueError, ZeroDivisionError) as e:
        return type(e)
    return np.asarray(got, dtype=np.int64)


def ours(s: VideoSampling, clip: ClipInfo) -> np.ndarray | type:
    try:
        return s.indices(clip)
    except SamplingError:
        return ValueError


def same(a: np.ndarray | type, b: np.ndarray | type) -> bool:
    if isinstance(a, type) or isinstance(b, type):
        return isinstance(a, type) and isinstance(b, type)
    return a.shape == b.shape and bool((a == b).all())


@settings(max_examples=400, deadline=None, derandomize=True)
@given(clip=clips, fps=rates, n=st.integers(1, 900), lo=st.integers(1, 16),
       hi=st.integers(1, 1000))
def test_qwen2_vl_indices_equal_the_processor(clip: ClipInfo, fps: float | None, n: int,
                                              lo: int, hi: int) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    proc = processor(*QWEN2)
    kw = {"fps": fps} if fps is not None else {"num_frames": n}
    s = VideoSampling("qwen2_vl", fps=fps, num_frames=None if fps else n, min_frames=lo,
                      max_frames=hi)
    ref = reference(proc, clip, min_frames=lo, max_frames=hi, temporal_patch_size=2, **kw)
    got = ours(s, clip)
    if not isinstance(ref, type) and len(ref) == 0:  # num_frames rounded to 0: ours refuses
        assert got is ValueError
        return
    assert same(got, ref), (clip, kw, lo, hi, got, ref)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(clip=clips, fps=rates, n=st.integers(1, 900), lo=st.integers(1, 16),
       hi=st.integers(1, 1000))
def test_qwen3_vl_indices_equal_the_processor(clip: ClipInfo, fps: float | None, n: int,
                                              lo: int, hi: int) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    proc = processor(*QWEN3, min_frames=lo, max_frames=hi)
    kw = {"fps": fps} if fps is not None else {"num_frames": n}
    s = VideoSampling("qwen3_vl", fps=fps, num_frames=None if fps else n, min_frames=lo,
                      max_frames=hi)
    assert same(ours(s, clip), reference(proc, clip, **kw)), (clip, kw, lo, hi)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(clip=clips, fps=rates, n=st.integers(1, 900))
def test_internvl_indices_equal_the_processor(clip: ClipInfo, fps: float | None,
                                              n: int) -> None:
    proc = processor(*INTERNVL)
    kw = {"fps": fps} if fps is not None else {"num_frames": n}
    s = VideoSampling("internvl", fps=fps, num_frames=None if fps else n)
    ref = reference(proc, clip, **kw)
    if not isinstance(ref, type) and len(ref) == 0:  # 0 frames at this fps: ours refuses
        assert ours(s, clip) is ValueError
        return
    assert same(ours(s, clip), ref), (clip, kw)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(total=st.integers(1, 100_000), n=st.integers(1, 5000), shift=st.booleans())
def test_float32_arange_equals_torch(total: int, n: int, shift: bool) -> None:
    step = total / n
    start = step / 2 if shift else 0
    want = torch.arange(start, total, step).int().numpy()
    assert np.array_equal(torch_arange_int(start, total, step), want)


def test_fps_and_num_frames_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exactly one of fps and num_frames"):
        VideoSampling("qwen2_vl", fps=2, num_frames=8)


CONFIGS = {
    "qwen2_vl": {"video_preprocessor_config.json": {
        "min_pixels": 3136, "max_pixels": 50176, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "max_frames": 64, "fps": 1.0},
        "preprocessor_config.json": {"max_pixels": 9}},
    "qwen2_vl_image_only": {"preprocessor_config.json": {
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}},
    "qwen3_vl": {"processor_config.json": {"video_processor": {
        "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16,
        "fps": 4, "min_frames": 2, "max_frames": 100}},
        "video_preprocessor_config.json": {"fps": 99}},
    "internvl": {"processor_config.json": {"image_seq_length": 256},
                 "video_preprocessor_config.json": {
                     "size": {"height": 448, "width": 448}, "num_frames": 16}},
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_checkpoint_settings_come_from_the_file_transformers_reads(tmp_path: Path,
                                                                   case: str) -> None:
    for name, d in CONFIGS[case].items():
        (tmp_path / name).write_text(json.dumps(d))
    ref, _ = BaseVideoProcessor.get_video_processor_dict(str(tmp_path))
    assert read_video_config(tmp_path) == ref
    plan = checkpoint_video(tmp_path, case.removesuffix("_image_only"))
    defaults = processor(*{"qwen2_vl": QWEN2, "qwen3_vl": QWEN3, "internvl": INTERNVL}[
        case.removesuffix("_image_only")])
    want = {**vars(defaults), **{k: v for k, v in ref.items() if k in vars(defaults)}}
    assert plan.mean == pytest.approx(want["image_mean"])
    assert plan.std == pytest.approx(want["image_std"])
    if isinstance(plan.layout, FrameTiles):
        assert plan.layout.tile == want["size"]["height"] == 448
        assert plan.sampling.num_frames == want["num_frames"] == 16
        return
    assert isinstance(plan.layout, QwenVideoLayout)
    q: QwenVLPreprocess = plan.layout.qwen
    size = dict(want["size"])
    if case.startswith("qwen2_vl"):  # Qwen2VLVideoProcessor.__init__: the old keys win
        size = {"shortest_edge": ref["min_pixels"], "longest_edge": ref["max_pixels"]}
    assert (q.min_pixels, q.max_pixels) == (size["shortest_edge"], size["longest_edge"])
    assert (q.patch, q.merge, q.temporal) == (want["patch_size"], want["merge_size"],
                                              want["temporal_patch_size"])
    s = plan.sampling
    assert (s.min_frames, s.max_frames) == (want["min_frames"], want["max_frames"])
    assert s.fps == (want["fps"] if want["fps"] is not None else 2.0)  # 2: ours, none set
