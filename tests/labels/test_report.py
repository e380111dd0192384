"""``vlmbatch report``'s page (``labels/report.py``, ``job_stats.py``): what it shows equals
what the store holds, counted here from the recorded lines (log-odds histogram bins,
yes-rates, label counts, errors by kind, the borderline images by the rule and the most
confident wrong ones by brute force, right and wrong counts from the labels the store
kept), and the page is self-contained (every image a decodable data: URL, no script,
nothing fetched, user text escaped). Rendering in Chromium: ``test_report_render.py``."""

from __future__ import annotations

import base64
import io
import re
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.labels.report_job import CHOICES, ODD_TEXT, make_job
from vlmbatch.labels.job_stats import BINS, bin_of, gather
from vlmbatch.labels.report import _histogram, thumbnail, write_report


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    return make_job(tmp_path_factory.mktemp("report"))


def lo(p: float) -> float:
    """Log-odds, P clipped to 6 decimals' range (what the page's axis and rule use)."""
    p = min(max(p, 1e-6), 1 - 1e-6)
    return float(np.log(p) - np.log1p(-p))


def test_what_the_page_shows_is_what_the_store_holds(job: tuple[Path, dict]) -> None:
    path, recorded = job
    r = gather(path, borderline=5)
    assert (r.status.items, r.status.done, r.status.failed) == (32, 30, 2)
    assert r.errors == Counter({"source": 1, "decode": 1})
    by_q = {q.question_id: q for q in r.questions}
    assert list(by_q) == ["red", "odd", "category", "far", "q0"]
    items = sorted(k for k in recorded if k.startswith("i"))
    for qid, thr in (("red", 0.3), ("odd", 0.5), ("far", 0.5)):
        q = by_q[qid]
        ps = [next(d for d in recorded[k] if d["question_id"] == qid)["p_yes"] for k in items]
        assert (q.answered, q.failed, q.threshold) == (30, 0, thr)
        assert q.yes == sum(p >= thr for p in ps)
        # bins 1 wide in log-odds over [-12, 12], the outer ones holding what lies beyond
        edges = [-np.inf, *range(-11, 12), np.inf]
        assert q.hist == [sum(a <= lo(p) < b for p in ps) for a, b in zip(edges, edges[1:])]
        # brute force: the answers within 1 of the threshold in log-odds, closest first
        dist = [abs(lo(p) - lo(thr)) for p in ps]
        near = sorted((k for k in range(30) if dist[k] <= 1), key=lambda k: (dist[k], k))
        assert q.near_count == len(near)
        assert [a.s.image_id for a in q.borderline()] == [items[k] for k in near[:5]]
        assert q.closest is not None and q.closest[0] == pytest.approx(min(dist))
    assert by_q["far"].near_count == 0 and by_q["far"].borderline() == []
    assert by_q["red"].near_count > 5 and by_q["odd"].near_count > 5
    red = by_q["red"]  # labelled: every 7th answer wrong
    wrong = [k for k in range(30) if k % 7 == 0]
    assert (red.labelled, red.right) == (30, 30 - len(wrong))
    ps = [recorded[items[k]][0]["p_yes"] for k in range(30)]
    most = sorted(wrong, key=lambda k: (-abs(lo(ps[k]) - lo(0.3)), k))
    assert [a.s.image_id for a in red.wrong_answers()] == [items[k] for k in most]
    assert all(a.expected != a.s.answer for a in red.wrong_answers())
    assert by_q["odd"].labelled == 0 and by_q["odd"].wrong_answers() == []
    cat = by_q["category"]
    labels = [next(d for d in recorded[k] if d["question_id"] == "category") for k in items]
    assert cat.is_label_set and cat.labels == Counter(d["label"] for d in labels)
    gaps = [float(np.log(np.divide(*sorted(d["probs"].values())[:-3:-1]))) for d in labels]
    near = sorted((k for k in range(30) if gaps[k] <= 1), key=lambda k: (gaps[k], k))
    assert cat.near_count == len(near) > 5
    assert [a.s.image_id for a in cat.borderline()] == [items[k] for k in near[:5]]
    assert (by_q["q0"].answered, by_q["q0"].failed) == (0, 2)


def test_the_histogram_puts_a_small_threshold_between_its_neighbours() -> None:
    """A calibrated threshold of 0.0093 fell inside the first of 20 linear bins, with
    everything under 0.05; on the log-odds axis the answers at 0.002 and 0.02 have bins of
    their own, on either side of the red line."""
    assert bin_of(0.002) < bin_of(0.0093) < bin_of(0.02) < bin_of(0.05) < bin_of(0.5)
    hist = [0] * BINS
    for p in (0.002, 0.02):
        hist[bin_of(p)] += 1
    svg = _histogram(hist, 0.0093)
    bars = [float(x) for x, height in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" '
                                                 r'width="[\d.]+" height="([\d.]+)"', svg)
            if float(height) > 0]
    (line,) = re.findall(r'<line x1="([\d.]+)" y1="0" x2="[\d.]+" y2="[\d.]+" '
                         r'stroke="#d33"', svg)
    assert len(bars) == 2 and bars[0] < float(line) < bars[1] - 2


def test_each_bar_s_tooltip_names_its_own_range() -> None:
    """Each bar's tooltip is its bin's P(yes) range, ends told apart (the bins near 1 read
    ``0.999955-0.999983``, where two significant digits said ``1-1``), each bin starting
    where the one before it ends, from 0 to 1; and the P(yes) of a line lands in the bin
    whose tooltip range holds it."""
    svg = _histogram(list(range(BINS)), 0.5)
    ranges = re.findall(r"<title>P\(yes\) ([^<:]+)-([^<:]+): (\d+)</title>", svg)
    assert [int(n) for _, _, n in ranges] == list(range(BINS))
    assert ranges[0][0] == "0" and ranges[-1][1] == "1"
    for (lo_, hi, _), (nxt, _, _) in zip(ranges, ranges[1:]):
        assert float(lo_) < float(hi) and hi == nxt, (lo_, hi, nxt)
    for p in (1e-6, 0.003, 0.2, 0.5, 0.93, 0.99991, 0.99999, 1.0):
        a, b, _ = ranges[bin_of(p)]
        assert float(a) <= p <= float(b) + 1e-6, (p, a, b)  # tooltips round to 2 digits


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
    r = write_report(path, out, borderline=4, thumb=96)
    page_text = out.read_text()
    page = Page()
    page.feed(page_text)
    assert page.tags["script"] == 0 and page.tags["link"] == 0 and "url(" not in page_text
    # red, odd, category: 4 borderline each, red 4 wrong too; far: none near, nothing wrong
    assert page.tags["img"] == len(page.srcs) == 4 * 3 + 4
    for src in page.srcs:
        head, data = src.split(",", 1)
        assert head == "data:image/jpeg;base64"
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            assert max(im.size) <= 96 and im.mode == "RGB"
    text = "".join(page.text)
    assert ODD_TEXT in text and "<b>bold</b>" not in page_text  # shown, escaped
    assert "source" in text and "decode" in text and "missing: cannot read" in text
    assert page.tags["svg"] == 4 and all(c in text for c in CHOICES[:1])
    assert text.count("Borderline:") == 3 and text.count("Nothing is near the threshold") == 1
    far = text[text.index("far: Is it far?"):]
    assert "Borderline" not in far
    assert "The closest, i00, has P(yes) 0.0002, 8.5 from it in log-odds" in far
    red = next(q for q in r.questions if q.question_id == "red")
    assert f"30 labelled: {red.right} right, {30 - red.right} wrong" in text
    assert "Wrong answers: 5 of 30 labelled, the 4 most confident first:" in text
    marks = re.findall(r'<figure class="(right|wrong)">', page_text)  # red's sheets only
    assert len(marks) == 8 and marks[4:] == ["wrong"] * 4
    assert page_text.count("<b>wrong</b>: expected ") == marks.count("wrong")


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
