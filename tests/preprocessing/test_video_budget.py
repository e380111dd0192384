"""A clip's visual token budget and the model's context (``preprocessing/video_budget.py``).

The size a budget gives is transformers' own ``smart_resize`` (Qwen2-VL's per frame,
Qwen3-VL's video one over the clip, run from transformers' source:
``transformers_source.py``) with the bound the module docstring states, wherever that size
fits the budget; the tokens counted from the rows a plan makes are within the budget always.
InternVL's frames are capped: the indices are transformers' rule for the capped count,
written here by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.preprocessing.transformers_source import function
from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess
from vlmbatch.preprocessing.video import VideoTooLarge
from vlmbatch.preprocessing.video_budget import qwen_budget_size, qwen_tokens
from vlmbatch.preprocessing.video_plan import VideoPlan
from vlmbatch.preprocessing.video_rows import FrameTiles, QwenVideoLayout
from vlmbatch.preprocessing.video_sampling import VideoSampling

QWEN2 = QwenVideoLayout(QwenVLPreprocess(14, 2, 2, 128 * 28 * 28, 768 * 28 * 28))
QWEN3 = QwenVideoLayout(QwenVLPreprocess(16, 2, 2, 128 * 32 * 32, 768 * 32 * 32 * 2), True)


def stated_bound(layout: QwenVideoLayout, frames_: int, budget: int) -> int:
    """The docstring's bound: per frame floor(B / groups) f^2; per clip B f^2 frames / groups."""
    f2, groups = layout.qwen.factor ** 2, -(-frames_ // 2)
    cap = budget * f2 * frames_ // groups if layout.clip_budget else budget // groups * f2
    return min(cap, layout.qwen.max_pixels)


QWEN2_REF = function("models/qwen2_vl/image_processing_qwen2_vl", "smart_resize")
QWEN3_REF = function("models/qwen3_vl/video_processing_qwen3_vl", "smart_resize")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(frames_=st.integers(2, 40), h=st.integers(16, 1500), w=st.integers(16, 1500),
       budget=st.integers(1, 3000), clip=st.booleans())
def test_the_budget_is_the_processors_bound(frames_: int, h: int, w: int, budget: int,
                                            clip: bool) -> None:
    if max(h, w) / min(h, w) > 100:
        return
    layout = QWEN3 if clip else QWEN2
    q, cap = layout.qwen, stated_bound(layout, frames_, budget)
    if clip:
        want = QWEN3_REF(frames_, h, w, temporal_factor=2, factor=q.factor,
                   min_pixels=min(q.min_pixels, cap), max_pixels=cap) if cap >= q.factor ** 2 \
            else None
    else:
        want = QWEN2_REF(h, w, q.factor, min(q.min_pixels, cap), cap) if cap >= q.factor ** 2 \
            else None
    try:
        got = qwen_budget_size(layout, frames_, h, w, budget)
    except VideoTooLarge as e:
        assert e.reason == "over_budget" and f"{budget:,} visual tokens" in str(e)
        assert want is None or qwen_tokens(layout, frames_, want) > budget
        return
    assert qwen_tokens(layout, frames_, got) <= budget
    own = layout.target_size(frames_, h, w)  # the checkpoint's own bound (test_video_rows)
    if budget >= qwen_tokens(layout, frames_, own):
        assert got == own  # a budget it fits changes nothing
    elif want is not None and qwen_tokens(layout, frames_, want) <= budget:
        assert got == want


@pytest.mark.parametrize("layout", [QWEN2, QWEN3], ids=["qwen2_vl", "qwen3_vl"])
def test_a_qwen_clip_is_made_smaller_not_shorter(layout: QwenVideoLayout) -> None:
    data = make_clip(frames(8, 320, 240), FFV1_MKV)
    family = "qwen3_vl" if layout.clip_budget else "qwen2_vl"
    plan = VideoPlan(VideoSampling(family, fps=None, num_frames=8), layout)
    free = plan.prepare(data, 10**9)
    budget = plan.tokens(free) // 3
    small = plan.with_sampling(max_tokens=budget).prepare(data, 10**9)
    assert small.frame_indices == free.frame_indices  # the same frames, smaller
    assert budget // 2 < plan.tokens(small) <= budget, (plan.tokens(small), budget)
    assert plan.tokens(small) == small.rows.shape[0] // 4  # merge 2 x 2
    with pytest.raises(VideoTooLarge, match="do not fit the budget of 3 visual tokens") as e:
        plan.with_sampling(max_tokens=3).prepare(data, 10**9)  # 4 temporal patches
    assert e.value.reason == "over_budget"


def test_an_internvl_clip_is_made_shorter_not_smaller() -> None:
    data = make_clip(frames(40, 48, 32), FFV1_MKV)
    plan = VideoPlan(VideoSampling("internvl", fps=None, num_frames=8), FrameTiles(32),
                     frame_tokens=16)
    assert plan.with_sampling(max_tokens=200).prepare(data, 10**9).frame_indices == \
        (2, 7, 12, 17, 22, 27, 32, 37)  # 8 x 16 = 128 tokens fit: unchanged
    got = plan.with_sampling(max_tokens=100).prepare(data, 10**9)  # 6 frames of 16 fit
    # transformers' InternVL rule for 6 of 40: arange(40/6/2, 40, 40/6) truncated
    assert got.frame_indices == (3, 10, 16, 23, 30, 36)
    assert got.rows.shape == (6, 32, 32, 3) and plan.tokens(got) == 96
    with pytest.raises(VideoTooLarge, match="one frame is 16 visual tokens"):
        plan.with_sampling(max_tokens=15).prepare(data, 10**9)


def test_a_clip_over_the_models_context_is_refused() -> None:
    data = make_clip(frames(12, 48, 32), FFV1_MKV)
    plan = VideoPlan(VideoSampling("internvl", fps=None, num_frames=12), FrameTiles(32),
                     frame_tokens=16, context=12 * 16)
    with pytest.raises(VideoTooLarge, match="192 visual tokens, over the model's context of "
                       "192") as e:
        plan.prepare(data, 10**9)
    assert e.value.reason == "over_context"
    ok = plan.with_sampling(max_tokens=100).prepare(data, 10**9)  # a budget under it: fits
    assert len(ok.frame_indices) == 6
    assert np.array_equal(ok.rows[0], plan.with_sampling(num_frames=6).prepare(
        data, 10**9).rows[0])


def test_windows_keep_the_budget_and_the_context() -> None:
    """Each window is its own prompt: the budget and the context bound it as a clip."""
    data = make_clip(frames(80, 48, 32), FFV1_MKV)  # 3.2 s at 25 fps: windows of 40 frames
    plan = VideoPlan(VideoSampling("internvl", fps=None, num_frames=8), FrameTiles(32),
                     frame_tokens=16).with_windows(1.6, 0.8)
    got = plan.with_sampling(max_tokens=100).prepare(data, 10**9)
    assert len(got.videos) == 3
    for k, video in enumerate(got.videos):  # 6 of each window's 40, shifted by its start
        assert video.frame_indices == tuple(20 * k + i for i in (3, 10, 16, 23, 30, 36))
    qwen = VideoPlan(VideoSampling("qwen2_vl", fps=None, num_frames=8), QWEN2).with_windows(
        1.6, 0.8)
    budget = qwen.tokens(qwen.prepare(data, 10**9).videos[0]) // 3
    alone = replace(qwen, windows=None).with_sampling(max_tokens=budget)
    for k, video in enumerate(qwen.with_sampling(max_tokens=budget).prepare(data, 10**9).videos):
        cut = alone.prepare(make_clip(frames(80, 48, 32)[20 * k:20 * k + 40], FFV1_MKV), 10**9)
        assert qwen.tokens(video) == qwen.tokens(cut) <= budget  # the clip cut at its bounds
        assert np.array_equal(video.rows, cut.rows)
    with pytest.raises(VideoTooLarge) as e:
        replace(plan, context=8 * 16).prepare(data, 10**9)  # a window is 8 x 16 tokens
    assert e.value.reason == "over_context"
