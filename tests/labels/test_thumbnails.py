"""The report's pictures of lists and clips (``labels/thumbnails.py``): which frames a clip's
strip shows (computed here by hand from the rule), that each picture is that frame shrunk
(clips made here, lossless FFV1, each frame one flat colour so a JPEG keeps it), a list's
first images with the rest counted, and unreadable sources as "unreadable", never an
exception.

Shown failing once with a fault injected: the strip's frames decoded in reverse order
(``clip_pictures`` zipping ``got.pixels[::-1]``) fails the colour check."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.preprocessing.video_clips import FFV1_MKV, make_clip
from vlmbatch.labels.thumbnails import (
    LIST_SHOWN,
    clip_pictures,
    item_pictures,
    list_pictures,
    strip_indices,
)
from vlmbatch.pipeline.media_inputs import ImageList, SamplingKeys, VideoInput


def colour(i: int) -> tuple[int, int, int]:
    return (12 * i % 256, 255 - 9 * i % 256, 37 * i % 256)


def flat_frames(n: int, w: int = 64, h: int = 48) -> np.ndarray:
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        out[i] = colour(i)
    return out


def pixels_of(url: str) -> np.ndarray:
    assert url.startswith("data:image/jpeg;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as im:
        return np.asarray(im.convert("RGB"))


def test_strip_indices_follow_the_rule() -> None:
    at25 = [k / 25 for k in range(40)]
    # no seconds (a failed answer): the middles of 4 equal segments of 20 frames
    assert strip_indices(at25[:20], None) == [2, 7, 12, 17]
    assert strip_indices(at25[:3], None) == [0, 1, 2]  # fewer frames than the strip
    # 8 frames seen (every 5th of 40): the 1st, 3rd, 6th and 8th of them (k * 7 / 3 rounded)
    seen = [k / 25 for k in range(0, 40, 5)]
    assert strip_indices(at25, seen) == [0, 10, 25, 35]
    assert strip_indices(at25, [0.0, 1.0]) == [0, 25]  # fewer seen than the strip
    # a second between frames goes to the nearest, on a variable frame rate too; one frame
    # nearest to two seconds is shown once
    vfr = [0.0, 0.1, 0.15, 0.5, 0.9]
    assert strip_indices(vfr, [0.12, 0.3, 0.34, 0.89]) == [1, 2, 3, 4]
    assert strip_indices(vfr, [0.12, 0.3, 0.31, 0.89]) == [1, 2, 4]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("thumbs")
    (d / "clip.mkv").write_bytes(make_clip(flat_frames(20), FFV1_MKV))  # 25 fps
    (d / "text.mp4").write_text("not a clip")
    for k in range(LIST_SHOWN + 2):
        Image.fromarray(flat_frames(1, 30 + k, 20)[0] * 0 + np.uint8(20 * k)).save(
            d / f"i{k}.png")
    return d


def test_a_strip_shows_the_frames_the_model_saw(folder: Path) -> None:
    seen = [0.0, 0.2, 0.4, 0.6]  # frames 0, 5, 10, 15
    pics = clip_pictures("clip.mkv", folder, 32, seen)
    assert [p.title for p in pics] == ["0.00 s", "0.20 s", "0.40 s", "0.60 s"]
    for p, i in zip(pics, (0, 5, 10, 15)):
        assert p.url is not None
        px = pixels_of(p.url)
        assert px.shape == (24, 32, 3)  # 64x48 at 32 on the longer side
        assert np.abs(px.reshape(-1, 3).mean(0) - colour(i)).max() <= 4, i
    failed = clip_pictures("clip.mkv", folder, 32)  # no seconds: segment middles
    assert [p.title for p in failed] == ["0.08 s", "0.28 s", "0.48 s", "0.68 s"]
    data = (folder / "clip.mkv").read_bytes()
    assert [p.url for p in clip_pictures(data, folder, 32, seen)] == [p.url for p in pics]


def test_unreadable_clips_give_no_pictures(folder: Path) -> None:
    assert clip_pictures("text.mp4", folder, 32) == []
    assert clip_pictures("nowhere.mkv", folder, 32) == []
    data = (folder / "clip.mkv").read_bytes()
    assert clip_pictures(data[: len(data) // 3], folder, 32, [0.0, 0.7]) == []


def test_a_list_shows_its_first_images_and_counts_the_rest(folder: Path) -> None:
    names = [f"i{k}.png" for k in range(LIST_SHOWN + 2)]
    pics, more = list_pictures(ImageList(tuple(names)), folder, 16)
    assert more == 2 and [p.title for p in pics] == [f"image {k + 1}" for k in range(6)]
    for k, p in enumerate(pics):
        assert p.url is not None
        assert abs(float(pixels_of(p.url).mean()) - 20 * k) <= 3
        assert pixels_of(p.url).shape[1] == 16  # the longer side (the width)
    pics, more = list_pictures(ImageList(("i0.png", "gone.png")), folder, 16)
    assert more == 0 and pics[0].url is not None and pics[1].url is None
    assert item_pictures("i0.png", folder, 16) is None  # one image: the report's own path
    clip = item_pictures(VideoInput("clip.mkv", SamplingKeys()), folder, 16, [0.0])
    assert clip is not None and len(clip[0]) == 1 and clip[1] == 0
