"""``vlmbatch report``'s page (``labels/report.py``): what it shows equals what the store holds,
counted here from the recorded lines (histogram bins, yes-rates, label counts, errors by
kind, the k most borderline images by brute force), and the page is self-contained (every
image a decodable data: URL, no script, nothing fetched, user text escaped). Rendering in
Chromium: ``test_report_render.py``."""

from __future__ import annotations

import base64
import io
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.labels.report_job import CHOICES, ODD_TEXT, make_job
from vlmbatch.labels.report import BINS, gather, thumbnail, write_report


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    return make_job(tmp_path_factory.mktemp("report"))


def test_what_the_page_shows_is_what_the_store_holds(job: tuple[Path, dict]) -> None:
    path, recorded = job
    r = gather(path, borderline=5)
    assert (r.status.items, r.status.done, r.status.failed) == (32, 30, 2)
    assert r.errors == Counter({"source": 1, "decode": 1})
    by_q = {q.question_id: q for q in r.questions}
    assert list(by_q) == ["red", "odd", "category", "q0"]
    items = sorted(k for k in recorded if k.startswith("i"))
    for qid, thr in (("red", 0.3), ("odd", 0.5)):
        q = by_q[qid]
        ps = [next(d for d in recorded[k] if d["question_id"] == qid)["p_yes"] for k in items]
        assert (q.answered, q.failed, q.threshold) == (30, 0, thr)
        assert q.yes == sum(p >= thr for p in ps)
        want = [sum(1 for p in ps if b / BINS <= p < (b + 1) / BINS or (b == BINS - 1 and
                                                                         p == 1.0))
                for b in range(BINS)]
        assert q.hist == want
        # brute force: sort every answer by its distance to the threshold, earlier first
        near = sorted(range(30), key=lambda k: (abs(ps[k] - thr), k))[:5]
        assert [s.image_id for s, _ in q.borderline()] == [items[k] for k in near]
    cat = by_q["category"]
    labels = [next(d for d in recorded[k] if d["question_id"] == "category") for k in items]
    assert cat.is_label_set and cat.labels == Counter(d["label"] for d in labels)
    gaps = [np.diff(sorted(d["probs"].values()))[-1] for d in labels]
    near = sorted(range(30), key=lambda k: (gaps[k], k))[:5]
    assert [s.image_id for s, _ in cat.borderline()] == [items[k] for k in near]
    assert (by_q["q0"].answered, by_q["q0"].failed) == (0, 2)


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: Counter[str] = Counter()
        self.srcs: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.srcs += [v or "" for k, v in attrs if k in ("src", "href")]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_the_page_is_self_contained(job: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = job
    out = tmp_path / "r.html"
    write_report(path, out, borderline=4, thumb=96)
    page_text = out.read_text()
    page = Page()
    page.feed(page_text)
    assert page.tags["script"] == 0 and page.tags["link"] == 0 and "url(" not in page_text
    assert page.tags["img"] == len(page.srcs) == 4 * 3  # 3 answered questions x 4
    for src in page.srcs:
        head, data = src.split(",", 1)
        assert head == "data:image/jpeg;base64"
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            assert max(im.size) <= 96 and im.mode == "RGB"
    text = "".join(page.text)
    assert ODD_TEXT in text and "<b>bold</b>" not in page_text  # shown, escaped
    assert "source" in text and "decode" in text and "missing: cannot read" in text
    assert page.tags["svg"] == 3 and all(c in text for c in CHOICES[:1])


def test_a_thumbnail_is_the_image_shrunk(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (300, 200, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    url = thumbnail("a.png", tmp_path, 64)
    assert url is not None
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as im:
        assert im.size == (43, 64)  # the longer side at 64, the aspect kept (Pillow rounds)
    assert thumbnail("nowhere.png", tmp_path) is None
    (tmp_path / "b.png").write_bytes(b"not an image")
    assert thumbnail("b.png", tmp_path) is None
