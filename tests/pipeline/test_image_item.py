"""``ImageItem`` built from what a user has (issue 38: it needed a ``base_dir`` and the
internal ``Question`` records): a path, bytes, a PIL image or an array; question strings or
objects; the current folder as its base. Readers' items (normalised already) are kept as
they are."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

import vlmbatch
from vlmbatch.pipeline.questions import ManifestError, Question
from vlmbatch.pipeline.records import ImageItem, image_source
from vlmbatch.preprocessing.sources import RowRef


def test_a_user_s_item_from_a_path_and_question_strings_and_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    it = vlmbatch.ImageItem(image=Path("a.png"), id="s2", questions=[
        "Is there a red shape?", {"id": "c", "text": "A circle?", "threshold": 0.7}])
    assert it == ImageItem("s2", "a.png", (Question("q0", "Is there a red shape?"),
                                           Question("c", "A circle?", 0.7)), tmp_path)
    one = ImageItem(7, "b.png", "Red?", base_dir=str(tmp_path / "x"))
    assert (one.id, one.questions, one.base_dir) == ("7", (Question("q0", "Red?"),),
                                                     tmp_path / "x")


def test_bad_questions_and_images_name_the_item() -> None:
    with pytest.raises(ManifestError, match=r"item 's2': question 1 threshold must be"):
        ImageItem("s2", "a.png", ["Red?", {"text": "Circle?", "threshold": 2}])
    with pytest.raises(ManifestError, match=r"item 's2': question 0 has unknown key\(s\) "
                                            r"\['treshold'\] \(did you mean 'threshold'\?\)"):
        ImageItem("s2", "a.png", [{"text": "Circle?", "treshold": 0.2}])
    with pytest.raises(ManifestError, match=r"item 's2': question ids repeat"):
        ImageItem("s2", "a.png", [{"id": "a", "text": "Red?"}, {"id": "a", "text": "Blue?"}])
    with pytest.raises(ManifestError, match="id must be a non-blank string"):
        ImageItem(None, "a.png", ["Red?"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not float"):
        ImageItem("s2", 1.5, ["Red?"])  # type: ignore[arg-type]


def _exif_image(orientation: int) -> Image.Image:
    """A JPEG 40x24 of distinct quadrants whose EXIF says ``orientation``."""
    rgb = np.zeros((24, 40, 3), np.uint8)
    rgb[:12, :20], rgb[:12, 20:], rgb[12:, :20] = (250, 0, 0), (0, 250, 0), (0, 0, 250)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    return Image.open(io.BytesIO(buf.getvalue()))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_pil_image_is_its_upright_rgb_pixels(orientation: int) -> None:
    """As ``ImageOps.exif_transpose(im).convert("RGB")`` (what the API did), without
    importing PIL where no PIL image can be."""
    im = _exif_image(orientation)
    want = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    got = ImageItem("a", im, ["Red?"]).image
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8
    assert got.shape == want.shape and np.array_equal(got, want)
    assert got.shape[:2] == ((24, 40) if orientation <= 4 else (40, 24))


def test_arrays_and_other_sources() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (5, 6, 3), np.uint8)
    gray, rgba = rgb[:, :, 0], np.dstack([rgb, np.full((5, 6), 9, np.uint8)])
    assert np.array_equal(image_source(gray), np.asarray(Image.fromarray(gray).convert("RGB")))
    assert np.array_equal(image_source(rgba),
                          np.asarray(Image.fromarray(rgba, "RGBA").convert("RGB")))
    assert image_source(rgb) is rgb
    ref = RowRef("t.parquet", 3, "image")
    for kept in (b"\x89PNG", "data:image/png;base64,AA", ref):
        assert image_source(kept) is kept
    q = (Question("q0", "Red?"),)
    it = ImageItem("x", ref, q, Path("/d"))  # a reader's item: nothing to convert
    assert it.image is ref and it.questions is q
