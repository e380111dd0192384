"""Windows of a long clip (``preprocessing/video_windows.py``): the arithmetic (written here
by hand from the rule in the module docstring), each window's frames, and each window
sampled and laid out as a clip cut out at its bounds is (a separate clip encoded here,
prepared by ``VideoPlan.prepare``: the reference), with shared frames decoded once and
hashing alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.preprocessing.media import PreparedVideo, WindowedClip
from vlmbatch.preprocessing.video import Clip, VideoError
from vlmbatch.preprocessing.video_plan import checkpoint_video
from vlmbatch.preprocessing.video_windows import window_spans, windows_of


@pytest.mark.parametrize("duration, seconds, stride, spans", [
    # on the grid: every start k*S while the window fits
    (12.0, 4, 2, [(0, 4), (2, 6), (4, 8), (6, 10), (8, 12)]),
    (12.0, 4, None, [(0, 4), (4, 8), (8, 12)]),
    # the clip's end not reached on the grid: one more window, ending with the clip
    (10.5, 4, 3, [(0, 4), (3, 7), (6, 10), (6.5, 10.5)]),
    (9.0, 4, None, [(0, 4), (4, 8), (5, 9)]),
    # a clip shorter than one window (or as long): one window, the whole clip
    (2.5, 4, 2, [(0, 2.5)]),
    (4.0, 4, 2, [(0, 4.0)]),
    # stride over the window: gaps, but the end is seen
    (10.0, 2, 5, [(0, 2), (5, 7), (8, 10)]),
    (12.0, 2, 5, [(0, 2), (5, 7), (10, 12)]),
    # a duration a hair under the grid's (float sums of frame times) still ends on it
    (12.0 - 1e-9, 4, 2, [(0, 4), (2, 6), (4, 8), (6, 10), (8, 12)]),
])
def test_window_spans(duration: float, seconds: float, stride: float | None,
                      spans: list[tuple[float, float]]) -> None:
    got = window_spans(duration, seconds, stride)
    assert len(got) == len(spans)
    for (s, e), (s2, e2) in zip(got, spans):
        assert s == pytest.approx(s2, abs=1e-6) and e == pytest.approx(e2, abs=1e-6)


def test_window_frames_are_those_within_its_bounds() -> None:
    times = np.arange(120) * 0.1  # 10 fps; 0.1 * k is not k / 10 exactly for some k
    ws = windows_of(times, 12.0, 4, 2)
    assert [(w.first, w.stop) for w in ws] == [(0, 40), (20, 60), (40, 80), (60, 100),
                                               (80, 120)]
    ws = windows_of(times, 12.0, 5, 5)  # 0-5, 5-10, then 7-12 (ends with the clip)
    assert [(w.first, w.stop) for w in ws] == [(0, 50), (50, 100), (70, 120)]
    with pytest.raises(VideoError, match="holds no frame") as e:
        windows_of(np.arange(4) * 1.0, 4.0, 0.3, 1.0)  # 1 fps, windows of 0.3 s
    assert e.value.reason == "too_short"


def _plan(tmp_path: Path, family: str):  # noqa: ANN202  (a VideoPlan: the class defaults)
    return checkpoint_video(tmp_path, family).with_sampling(fps=2)


@pytest.mark.parametrize("family", ["internvl", "qwen2_vl", "qwen3_vl"])
def test_each_window_is_sampled_as_a_clip_cut_at_its_bounds(tmp_path: Path,
                                                            family: str) -> None:
    """Windows of 4 s every 2 s of a 12 s clip at 10 fps (and one ending with the clip, for
    10.5 s): each window's indices, seconds and rows equal those of a clip made of its
    frames alone (encoded here), shifted by its first frame."""
    px = frames(105, 32, 24)
    data = make_clip(px, FFV1_MKV, rate=10)
    plan = _plan(tmp_path, family)
    got = plan.with_windows(4, 2).prepare(data, 10**9)
    assert isinstance(got, WindowedClip)
    assert got.windows == ((0.0, 4.0), (2.0, 6.0), (4.0, 8.0), (6.0, 10.0), (6.5, 10.5))
    for (start, end), video in zip(got.windows, got.videos):
        first, stop = round(start * 10), round(end * 10)
        alone = plan.prepare(make_clip(px[first:stop], FFV1_MKV, rate=10), 10**9)
        assert isinstance(alone, PreparedVideo)
        assert list(video.frame_indices) == [first + i for i in alone.frame_indices]
        assert video.seconds == pytest.approx([start + s for s in alone.seconds], abs=1e-9)
        np.testing.assert_array_equal(video.rows, alone.rows)
        assert video.group_hashes == alone.group_hashes and video.fps == alone.fps
        assert video.grid == alone.grid


@pytest.mark.parametrize("family, groups", [("internvl", 24), ("qwen2_vl", 12)])
def test_half_overlapping_windows_share_groups_and_decode_each_frame_once(
        tmp_path: Path, family: str, groups: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 2 fps of a 10 fps clip a 4 s window samples 8 frames, one every 5 source frames;
    its 2 s stride is 4 of them, so half-overlapping windows pick the same frames where
    they overlap: 5 windows, 24 distinct frames (InternVL: a group each; Qwen: 12 groups of
    2). Each distinct frame is decoded once, and the shared groups hash alike."""
    decoded: list[int] = []
    frames_of = Clip.frames

    def counted(self: Clip, indices: np.ndarray, fit=None):  # noqa: ANN001, ANN202
        decoded.extend(int(i) for i in indices)
        return frames_of(self, indices, fit)

    monkeypatch.setattr(Clip, "frames", counted)
    data = make_clip(frames(120, 32, 24), FFV1_MKV, rate=10)
    got = _plan(tmp_path, family).with_windows(4, 2).prepare(data, 10**9)
    assert isinstance(got, WindowedClip) and len(got.videos) == 5
    hashes = [h for v in got.videos for h in v.group_hashes]
    assert len(hashes) == 40 if family == "internvl" else 20
    assert len(set(hashes)) == groups
    for a, b in zip(got.videos, got.videos[1:]):  # the second half of one = first of next
        half = len(a.group_hashes) // 2
        assert a.group_hashes[half:] == b.group_hashes[:half]
    sampled = {i for v in got.videos for i in v.frame_indices}
    assert len(sampled) == 24 and sorted(decoded) == sorted(sampled)
