"""``vlmbatch report JOB -o report.html``: one self-contained HTML page about a job.

The page: the job's counts, QPM and its failed images by error kind; per question the
yes-rate and a histogram of P(yes) with the threshold marked (a label-set question: its
label distribution); and a contact sheet of the question's most borderline images, closest
to the threshold (a label set: smallest gap between the two most probable choices), each a
thumbnail with its P(yes) (or label and probability).

Self-contained: the styles are inline, the charts inline SVG, the thumbnails JPEG ``data:``
URLs; the page runs no script and loads nothing, so it opens offline, mailed or archived.
Read in one pass over the store in bounded memory: per question, histogram counts and a heap
of the ``borderline`` closest images; only those are read again and shrunk.
"""

from __future__ import annotations

import base64
import heapq
import html
import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageOps

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.jobs.folder import STORE_FILE, JobStatus, job_task, load_config, status
from vlmbatch.jobs.manifest import ManifestError
from vlmbatch.jobs.store import JobStore, item_from_json
from vlmbatch.labels.read import Scored, scored
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.preprocessing.sources import SourceError, read_bytes

BINS = 20  # P(yes) histogram bins


@dataclass
class QuestionStats:
    """What the page shows of one question, gathered line by line."""
    question_id: str
    text: str
    threshold: float
    answered: int = 0
    failed: int = 0
    yes: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * BINS)
    labels: Counter[str] = field(default_factory=Counter)  # label-set questions
    # the most borderline answers as a max-heap on distance: (-distance, order, line, image)
    near: list[tuple[float, int, Scored, tuple[str, Path]]] = field(
        default_factory=list)

    @property
    def is_label_set(self) -> bool:
        return bool(self.labels)

    def add(self, s: Scored, image: tuple[str, Path], keep: int, order: int) -> None:
        if s.error is not None:
            self.failed += 1
            return
        self.answered += 1
        if s.probs is not None:
            self.labels[str(s.answer)] += 1
            top = sorted((p for _, p in s.probs), reverse=True)
            distance = top[0] - (top[1] if len(top) > 1 else 0.0)
        else:
            p = float(s.p_yes or 0.0)
            self.yes += s.answer == "yes"
            self.hist[min(int(p * BINS), BINS - 1)] += 1
            distance = abs(p - self.threshold)
        entry = (-distance, -order, s, image)  # ties: the earlier line stays
        if len(self.near) < keep:
            heapq.heappush(self.near, entry)
        elif keep and entry > self.near[0]:
            heapq.heapreplace(self.near, entry)

    def borderline(self) -> list[tuple[Scored, tuple[str, Path]]]:
        """The kept answers, closest first."""
        return [(s, im) for _, _, s, im in sorted(self.near, key=lambda e: (-e[0], -e[1]))]


@dataclass(frozen=True)
class JobReport:
    job: Path
    status: JobStatus
    model: str
    questions: list[QuestionStats]
    errors: Counter[str]  # error kind -> failed images
    error_example: dict[str, str]  # error kind -> one message


def gather(job: Path, borderline: int = 8) -> JobReport:
    """One pass over the job's store."""
    if job_task(job) != "answer":
        raise ManifestError(f"{job} is an embedding job: a report covers jobs that answer "
                            "questions")
    st, cfg = status(job), load_config(job)
    per_q: dict[str, QuestionStats] = {}
    errors: Counter[str] = Counter()
    example: dict[str, str] = {}
    store = JobStore(Path(job) / STORE_FILE)
    try:
        for n, (item, lines) in enumerate(store.recorded_items(item_from_json)):
            _add_item(item, lines, per_q, borderline, n)
            failed = next((d for d in lines if d.get("error")), None)
            if failed is not None:
                kind = str(failed.get("error_kind") or "unknown")
                errors[kind] += 1
                example.setdefault(kind, str(failed["error"]))
    finally:
        store.close()
    model = str(cfg.model.path) if cfg.model.path is not None else "the built-in model"
    return JobReport(Path(job), st, model, list(per_q.values()), errors, example)


def _add_item(item: ImageItem, lines: list[dict], per_q: dict[str, QuestionStats],
              keep: int, order: int) -> None:
    thresholds = {q.id: q.threshold for q in item.questions}
    for d in lines:
        s = scored(d, f"item {item.id!r}")
        q = per_q.get(s.question_id)
        if q is None:
            q = per_q[s.question_id] = QuestionStats(s.question_id, s.question,
                                                     thresholds.get(s.question_id, 0.5))
        q.add(s, (item.source, item.base_dir), keep, order)


def thumbnail(image: str, base_dir: Path, size: int = 128) -> str | None:
    """A JPEG ``data:`` URL of the image shrunk to ``size`` pixels on its longer side (EXIF
    orientation applied); None when it cannot be read (the page says so)."""
    try:
        data = read_bytes(image, base_dir)
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (size, size))  # a JPEG decodes at 1/2..1/8 scale when it can
            small = ImageOps.exif_transpose(im).convert("RGB")
        small.thumbnail((size, size))
        buf = io.BytesIO()
        small.save(buf, "JPEG", quality=85)
    except (SourceError, OSError, ValueError, Image.DecompressionBombError):
        return None
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def write_report(job: Path, out: Path, borderline: int = 8, thumb: int = 128) -> JobReport:
    """Gather and write the page, whole or not at all (``out``'s folders made)."""
    r = gather(Path(job), borderline)
    page = render(r, thumb)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with replaced_on_success(Path(out)) as part:
        Path(part).write_text(page, encoding="utf-8")
    return r


# --- HTML ---------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2330;background:#fff}
h1{font-size:22px;margin:0 0 12px} h2{font-size:17px;margin:28px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px} td,th{padding:3px 10px;text-align:left;
border-bottom:1px solid #dde2ea} th{background:#f2f4f8} .num{text-align:right}
.muted{color:#667085} .sheet{display:flex;flex-wrap:wrap;gap:10px}
figure{margin:0;width:140px;padding:6px;border:1px solid #dde2ea;border-radius:6px;
background:#f8f9fb} figure img{display:block;max-width:128px;max-height:128px;margin:auto}
figcaption{font-size:12px;margin-top:4px;word-break:break-all}
.none{width:128px;height:64px;background:#eceff4;display:flex;align-items:center;
justify-content:center;font-size:11px;color:#667085}
svg{display:block;margin:6px 0}
"""

e = html.escape


def render(r: JobReport, thumb: int = 128) -> str:
    body = [f"<h1>vlmbatch report: {e(str(r.job))}</h1>", _summary(r), _errors(r)]
    if not r.questions:
        body.append('<p class="muted">No answers recorded yet.</p>')
    body += [_question(q, thumb) for q in r.questions]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>vlmbatch report: {e(r.job.name)}</title><style>{STYLE}</style></head>"
            "<body>\n" + "\n".join(body) + "\n</body></html>\n")


def _rows(pairs: list[tuple[str, str]]) -> str:
    return "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in pairs)


def _summary(r: JobReport) -> str:
    s = r.status
    qpm = f"{s.qpm:.0f}" if s.qpm else "n/a"
    return ("<table>" + _rows([
        ("status", s.status), ("model", r.model),
        ("images", f"{s.items} ({s.done} done, {s.failed} failed, {s.pending} pending)"),
        ("questions recorded", str(s.questions)), ("QPM (last run)", qpm)]) + "</table>")


def _errors(r: JobReport) -> str:
    if not r.errors:
        return "<h2>Errors</h2><p class=\"muted\">No image failed.</p>"
    rows = "".join(f"<tr><td>{e(k)}</td><td class=\"num\">{n}</td><td>"
                   f"{e(r.error_example[k][:200])}</td></tr>" for k, n in r.errors.most_common())
    return ("<h2>Errors by kind</h2><table><tr><th>kind</th><th>images</th><th>example</th>"
            f"</tr>{rows}</table>")


def _question(q: QuestionStats, thumb: int) -> str:
    head = f"<h2>{e(q.question_id)}: {e(q.text)}</h2>"
    if not q.answered:
        return head + f'<p class="muted">No answer ({q.failed} failed).</p>'
    if q.is_label_set:
        stats = f"{q.answered} answered, {q.failed} failed"
        chart = _label_bars(q.labels)
        what = "smallest gap between the two most probable choices"
    else:
        stats = (f"{q.answered} answered, {q.failed} failed; yes-rate "
                 f"{q.yes / q.answered:.1%} at threshold {q.threshold:g}")
        chart = _histogram(q.hist, q.threshold)
        what = f"P(yes) closest to the threshold {q.threshold:g}"
    sheet = "".join(_figure(s, im, thumb) for s, im in q.borderline())
    return (f"{head}<p>{e(stats)}</p>{chart}<p class=\"muted\">Most borderline ({e(what)}):"
            f"</p><div class=\"sheet\">{sheet}</div>")


def _figure(s: Scored, image: tuple[str, Path], thumb: int) -> str:
    url = thumbnail(image[0], image[1], thumb)
    pic = (f'<img src="{url}" alt="{e(s.image_id)}">' if url
           else '<div class="none">image unreadable</div>')
    if s.probs is not None:
        what = f"{s.answer} {dict(s.probs).get(str(s.answer), 0.0):.3f}"
    else:
        what = f"P(yes) {float(s.p_yes or 0.0):.4f} ({s.answer})"
    return f"<figure>{pic}<figcaption>{e(s.image_id)}<br>{e(what)}</figcaption></figure>"


def _histogram(hist: list[int], threshold: float, w: int = 480, h: int = 120) -> str:
    """Bars of the P(yes) counts over [0, 1], the threshold as a red line."""
    top = max(max(hist), 1)
    bw = w / len(hist)
    bars = "".join(
        f'<rect x="{i * bw + 1:.1f}" y="{h - 20 - (h - 30) * n / top:.1f}" '
        f'width="{bw - 2:.1f}" height="{(h - 30) * n / top:.1f}" fill="#4a78c2">'
        f"<title>{i / len(hist):.2f}-{(i + 1) / len(hist):.2f}: {n}</title></rect>"
        for i, n in enumerate(hist))
    x = threshold * w
    axis = (f'<line x1="0" y1="{h - 20}" x2="{w}" y2="{h - 20}" stroke="#667085"/>'
            f'<text x="0" y="{h - 5}" font-size="11">0</text>'
            f'<text x="{w - 8}" y="{h - 5}" font-size="11">1</text>'
            f'<text x="{w / 2 - 20}" y="{h - 5}" font-size="11">P(yes)</text>'
            f'<text x="2" y="10" font-size="11">{top}</text>')
    mark = (f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{h - 20}" stroke="#d33" '
            'stroke-width="2"/>')
    return (f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
            f'aria-label="P(yes) histogram">{bars}{axis}{mark}</svg>')


def _label_bars(labels: Counter[str], w: int = 480) -> str:
    """A horizontal bar per label, its count beside it."""
    top = max(labels.values())
    rows = labels.most_common()
    h = 22 * len(rows) + 4
    bars = "".join(
        f'<text x="0" y="{22 * i + 16}" font-size="12">{e(label[:18])}</text>'
        f'<rect x="130" y="{22 * i + 4}" width="{(w - 190) * n / top:.1f}" height="16" '
        f'fill="#4a78c2"/><text x="{136 + (w - 190) * n / top:.1f}" y="{22 * i + 16}" '
        f'font-size="12">{n}</text>' for i, (label, n) in enumerate(rows))
    return (f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
            f'aria-label="label distribution">{bars}</svg>')
