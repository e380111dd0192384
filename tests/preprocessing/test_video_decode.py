"""Clips decoded as sampled (``preprocessing/video.py``): the frames drawn into lossless clips
come back exactly, seeking equals decoding everything then indexing (B-frames included), the
display matrix is applied, a variable-frame-rate clip's seconds are its frames' own; every
bad clip is a ``VideoError`` with its reason; a clip is prepared in a decoder process under
its deadline. Clips are made in the tests (``video_clips.py``)."""

from __future__ import annotations

import functools
import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from tests import fault_points as fp
from tests.preprocessing.video_clips import FFV1_MKV, X264_MP4, decode_all, frames, make_clip
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.isolated import DecoderPool, DecodeTimeout
from vlmbatch.preprocessing.prepare import TilingConfig
from vlmbatch.preprocessing.video import Clip, VideoError, VideoTooLarge, open_clip
from vlmbatch.preprocessing.video_plan import VideoPlan
from vlmbatch.preprocessing.video_rows import FrameTiles
from vlmbatch.preprocessing.video_sampling import VideoSampling
from vlmbatch.preprocessing.video_source import VideoSource

MPEG4_BF = ("mp4", "mpeg4", "yuv420p", {"bf": "2", "g": "12"})  # lossy, B-frames reordered
X264_GOP = ("mp4", "libx264rgb", "rgb24",
            {"qp": "0", "x264-params": "keyint=6:min-keyint=6:scenecut=0"})
BIG = 10**9


def clip(data: bytes, **kw: float) -> Clip:
    return open_clip(data, int(kw.get("max_pixels", BIG)), kw.get("max_seconds", 1e9))


@pytest.mark.parametrize("kind", [FFV1_MKV, X264_MP4, X264_GOP])
def test_sampled_frames_are_the_frames_drawn(kind: tuple) -> None:
    px = frames(31, 64, 48)
    data = make_clip(px, kind)
    rng = np.random.default_rng(0)
    with clip(data) as c:
        assert c.info.total_frames == 31 and c.info.fps == 25.0
        for _ in range(6):
            idx = np.sort(rng.integers(0, 31, int(rng.integers(1, 12))))
            got = c.frames(idx)
            assert np.array_equal(got.pixels, px[idx])
            assert got.seconds == pytest.approx([i / 25 for i in idx], abs=1e-9)


def test_seeking_equals_decoding_everything_with_b_frames() -> None:
    data = make_clip(frames(40, 64, 48), MPEG4_BF)
    everything, _ = decode_all(data)
    with clip(data) as c:
        assert len(c.index.keys) < 40  # real GOPs: some frames need earlier ones
        for idx in ([0, 39], [5, 6, 7, 20, 21, 38], [13] * 3, list(range(0, 40, 3)), [39]):
            assert np.array_equal(c.frames(np.array(idx)).pixels, everything[idx]), idx


def test_a_rotated_clip_reaches_the_model_upright() -> None:
    px = frames(4, 64, 48)
    for rotation, turns in ((90, 1), (-90, 3), (180, 2)):
        with clip(make_clip(px, X264_MP4, rotation=rotation)) as c:
            got = c.frames(np.array([0, 3]))
            assert np.array_equal(got.pixels, np.rot90(px[[0, 3]], turns, axes=(1, 2)))
            assert (got.width, got.height) == ((48, 64) if turns % 2 else (64, 48))


def test_variable_frame_rate_seconds_are_the_frames_own() -> None:
    pts = [0, 40, 100, 110, 300, 310, 500, 900]  # ms
    px = frames(len(pts), 32, 32)
    data = make_clip(px, FFV1_MKV, pts=pts, time_base=Fraction(1, 1000))
    with clip(data) as c:
        assert c.info.total_frames == 8
        got = c.frames(np.array([1, 3, 4, 7]))
        assert got.seconds == pytest.approx([0.04, 0.11, 0.3, 0.9])
        assert np.array_equal(got.pixels, px[[1, 3, 4, 7]])


def test_each_frame_is_fit_as_decoded() -> None:
    px = frames(6, 64, 48)
    with clip(make_clip(px, FFV1_MKV)) as c:
        got = c.frames(np.array([1, 2]), fit=lambda img: img[::2, ::4])
    assert np.array_equal(got.pixels, px[[1, 2], ::2, ::4])
    assert (got.width, got.height) == (64, 48)


# -- bad input: each a VideoError (an ImageError: the item's error) with its reason --------

def audio_clip(video_track: bool) -> bytes:
    """A Matroska file with 0.1 s of silence and, if ``video_track``, a video track that
    holds no frame (the audio keeps the file openable)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        if video_track:
            v = c.add_stream("ffv1", rate=25)
            v.width, v.height, v.pix_fmt = 32, 32, "bgr0"
        s = c.add_stream("pcm_s16le", rate=8000)
        f = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                       layout="mono")
        f.sample_rate, f.pts = 8000, 0
        for p in [*s.encode(f), *s.encode()]:
            c.mux(p)
    return buf.getvalue()


def unknown_codec() -> bytes:
    data = make_clip(frames(3, 32, 32), FFV1_MKV)
    assert data.count(b"V_FFV1") == 1
    return data.replace(b"V_FFV1", b"V_ZZZZ")  # same length: the file stays well-formed


def truncated(kind: tuple, faststart: bool = False) -> bytes:
    data = make_clip(frames(30, 64, 48), kind)
    return data[: len(data) * 6 // 10]


BAD = {
    "text named .mp4": (b"hello, this is not a video\n" * 20, "not_a_video"),
    "empty": (b"", "not_a_video"),
    "audio only": (audio_clip(video_track=False), "no_video_stream"),
    "zero frames": (audio_clip(video_track=True), "no_frames"),
    "unknown codec": (unknown_codec(), "unsupported_codec"),
    "truncated mkv": (truncated(FFV1_MKV), "truncated"),
    "truncated mp4": (truncated(X264_MP4), "not_a_video"),  # its index (moov) is at the end
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_clips_are_the_items_error(case: str) -> None:
    data, reason = BAD[case]
    plan = VideoPlan(VideoSampling("internvl", fps=None, num_frames=2), FrameTiles(32))
    with pytest.raises(VideoError) as e:
        plan.prepare(data, BIG)
    assert e.value.reason == reason, str(e.value)
    assert isinstance(e.value, ImageError) and not isinstance(e.value, ImageTooLarge)


def test_8k_frames_are_refused_by_the_per_frame_pixel_limit_unread() -> None:
    big = np.zeros((1, 4320, 7680, 3), np.uint8)
    data = make_clip(big, ("matroska", "libx264", "yuv420p", {"preset": "ultrafast"}))
    with pytest.raises(VideoTooLarge) as e:
        open_clip(data, 3840 * 2160)
    assert e.value.reason == "too_many_pixels" and isinstance(e.value, ImageTooLarge)
    assert "7680x4320 = 33,177,600 pixels, over the limit of 8,294,400" in str(e.value)
    with open_clip(data, 7680 * 4320) as c:  # at the limit: read
        assert c.info.total_frames == 1


def test_a_clip_over_max_seconds_is_refused() -> None:
    data = make_clip(frames(12, 32, 32), FFV1_MKV, rate=1)  # 12 s
    with pytest.raises(VideoTooLarge) as e:
        open_clip(data, BIG, max_seconds=10)
    assert e.value.reason == "too_long" and "12.0 s long, over the limit of 10 s" in str(e.value)
    with open_clip(data, BIG, max_seconds=12) as c:
        assert c.info.duration == 12.0


def test_a_clip_too_short_for_its_sampling() -> None:
    plan = VideoPlan(VideoSampling("internvl", fps=None, num_frames=8), FrameTiles(32))
    with pytest.raises(VideoError) as e:
        plan.prepare(make_clip(frames(5, 32, 32)), BIG)
    assert e.value.reason == "too_short" and "5 frames, fewer than the 8 asked" in str(e.value)


# -- in the decoder processes ----------------------------------------------------------------

PLAN = VideoPlan(VideoSampling("internvl", fps=None, num_frames=4), FrameTiles(32))


def test_a_clip_is_prepared_in_a_decoder_process_as_here(tmp_path: Path) -> None:
    data = make_clip(frames(16, 64, 48), FFV1_MKV)
    (tmp_path / "clip.mkv").write_bytes(data)
    (tmp_path / "text.mp4").write_text("hello")
    pool = DecoderPool(1, TilingConfig(tile_size=56), BIG, 30.0, slot_bytes=4096)
    try:
        by_path = pool.submit(VideoSource("clip.mkv", PLAN), tmp_path).result(timeout=60)
        by_bytes = pool.submit(VideoSource(data, PLAN), tmp_path).result(timeout=60)
        with pytest.raises(VideoError) as e:
            pool.submit(VideoSource("text.mp4", PLAN), tmp_path).result(timeout=60)
        assert e.value.reason == "not_a_video"
    finally:
        pool.stop()
    here = PLAN.prepare(data, BIG)
    for got in (by_path, by_bytes):
        assert np.array_equal(got.rows, here.rows) and got.group_hashes == here.group_hashes
        assert got.frame_indices == here.frame_indices == (2, 6, 10, 14)
        assert got.seconds == here.seconds


def test_a_clip_that_hangs_times_out_and_the_next_goes_on(tmp_path: Path) -> None:
    data = make_clip(frames(8, 32, 32), FFV1_MKV)
    for name in ("a.mkv", "hang.mkv", "b.mkv"):
        (tmp_path / name).write_bytes(data)
    pool = DecoderPool(1, TilingConfig(tile_size=56), BIG, 2.0,
                       before=functools.partial(fp.hang_on, "hang"))
    try:
        futures = [pool.submit(VideoSource(n, PLAN), tmp_path)
                   for n in ("a.mkv", "hang.mkv", "b.mkv")]
        assert futures[0].result(timeout=60).rows.shape == (4, 32, 32, 3)
        with pytest.raises(DecodeTimeout):
            futures[1].result(timeout=60)
        assert futures[2].result(timeout=60).rows.shape == (4, 32, 32, 3)
    finally:
        pool.stop()
