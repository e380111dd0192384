"""``vlmbatch report JOB -o report.html``: one self-contained HTML page about a job.

The page: the job's counts, QPM and its failed images by error kind; per question the
yes-rate and a histogram of P(yes) on a log-odds axis with the threshold marked (a label-set
question: its label distribution); a contact sheet of its borderline images, closest to the
threshold first, or a line saying that none is near; and when the job's manifest carried
labels (``expected``, kept by the store), each shown answer marked right or wrong, the
question's count of each, and a sheet of its most confident wrong answers. What is counted,
the borderline rule and the histogram's bins: ``job_stats.py``.

Self-contained: the styles are inline, the charts inline SVG, the thumbnails JPEG ``data:``
URLs; the page runs no script and loads nothing, so it opens offline, mailed or archived.
Only the images shown are read again, and shrunk. An item of several images shows them in a
row; a clip a strip of a few of the frames the model saw (``thumbnails.py``).
"""

from __future__ import annotations

import html
import math
from collections import Counter
from pathlib import Path

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.labels.job_stats import (
    LOGITS,
    NEAR,
    JobReport,
    QuestionStats,
    Shown,
    gather,
    logit,
    sigmoid,
)
from vlmbatch.labels.review.loop import export_command, reviewed
from vlmbatch.labels.thumbnails import Picture, item_pictures, thumbnail
from vlmbatch.pipeline.media_inputs import VideoInput


def write_report(job: Path, out: Path, borderline: int = 8, thumb: int = 128,
                 labels: Path | None = None) -> JobReport:
    """Gather and write the page, whole or not at all (``out``'s folders made); ``labels``:
    reviewed labels (``review import``), counted per question."""
    r = gather(Path(job), borderline)
    page = render(r, thumb, None if labels is None else reviewed(Path(job), labels))
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
figure.right{border:2px solid #2e8540} figure.wrong{border:2px solid #d33}
.none{width:128px;height:64px;background:#eceff4;display:flex;align-items:center;
justify-content:center;font-size:11px;color:#667085}
svg{display:block;margin:6px 0}
.strip{display:flex;flex-wrap:wrap;gap:2px;justify-content:center;align-items:center}
.strip img{margin:0} .strip .gap,.strip .more{font-size:11px;
color:#667085;padding:0 3px}
"""

e = html.escape


def render(r: JobReport, thumb: int = 128,
           review: dict[str, tuple[int, int]] | None = None) -> str:
    body = [f"<h1>vlmbatch report: {e(str(r.job))}</h1>", _summary(r), _errors(r),
            _review(r, review)]
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


def _review(r: JobReport, review: dict[str, tuple[int, int]] | None) -> str:
    """How to review the borderline answers in Label Studio, and what was reviewed."""
    how = (f"<h2>Review</h2><p>Borderline answers to review in Label Studio (docs/labels.md): "
           f"<code>{e(export_command(r.job))}</code></p>")
    if review is None:
        return how
    rows = "".join(f"<tr><td>{e(q.question_id)}</td><td class=\"num\">{n}</td>"
                   f"<td class=\"num\">{agreed}</td><td class=\"num\">{n - agreed}</td></tr>"
                   for q in r.questions for n, agreed in [review.get(q.question_id, (0, 0))])
    total = sum(n for n, _ in review.values())
    return (how + f"<p>{total} answers reviewed.</p><table><tr><th>question</th>"
            f"<th>reviewed</th><th>reviewer agreed</th><th>reviewer changed</th></tr>{rows}"
            "</table>")


def _question(q: QuestionStats, thumb: int) -> str:
    head = f"<h2>{e(q.question_id)}: {e(q.text)}</h2>"
    if not q.answered:
        return head + f'<p class="muted">No answer ({q.failed} failed).</p>'
    stats = f"{q.answered} answered, {q.failed} failed"
    if not q.is_label_set:
        stats += f"; yes-rate {q.yes / q.answered:.1%} at threshold {q.threshold:g}"
    if q.labelled:
        stats += (f"; {q.labelled} labelled: {q.right} right, {q.labelled - q.right} wrong "
                  f"(accuracy {q.right / q.labelled:.1%})")
    chart = _label_bars(q.labels) if q.is_label_set else _histogram(q.hist, q.threshold)
    parts = [head, f"<p>{e(stats)}</p>", chart, _near(q, thumb)]
    if q.wrong:
        parts.append(f'<p class="muted">Wrong answers: {q.labelled - q.right} of {q.labelled} '
                     f"labelled, the {len(q.wrong)} most confident first:</p>"
                     + _sheet(q.wrong_answers(), thumb))
    return "".join(parts)


def _near(q: QuestionStats, thumb: int) -> str:
    """The borderline sheet (``NEAR``), or the line saying nothing is near."""
    if q.is_label_set:
        rule = "its two most probable choices within a factor e (log p1/p2 <= 1)"
    else:
        t = logit(q.threshold)
        rule = (f"P(yes) within a factor e in odds of the threshold {q.threshold:g}: "
                f"{sigmoid(t - NEAR):.3g} to {sigmoid(t + NEAR):.3g}")
    if not q.near_count:
        assert q.closest is not None  # answered
        d, s = q.closest
        what = (f"P(yes) {float(s.p_yes or 0.0):.4f}" if s.probs is None
                else f"{s.answer} {s.confidence or 0.0:.4f}")
        return (f'<p class="muted">Nothing is near the threshold: no answer has {e(rule)}. '
                f"The closest, {e(s.image_id)}, has {e(what)}, {d:.1f} from it in log-odds."
                "</p>")
    return (f'<p class="muted">Borderline: {q.near_count} answer(s) with {e(rule)}; the '
            f"{len(q.near)} closest first:</p>" + _sheet(q.borderline(), thumb))


def _sheet(shown: list[Shown], thumb: int) -> str:
    return '<div class="sheet">' + "".join(_figure(a, thumb) for a in shown) + "</div>"


def _figure(a: Shown, thumb: int) -> str:
    s = a.s
    many = item_pictures(a.media, a.image[1], max(thumb // 2, 16), s.seconds)
    if many is not None:  # a list's images, a clip's strip of frames
        pic = _strip(*many, s.image_id, "clip" if isinstance(a.media, VideoInput) else "list")
    else:
        url = thumbnail(a.image[0], a.image[1], thumb)
        pic = (f'<img src="{url}" alt="{e(s.image_id)}">' if url
               else '<div class="none">image unreadable</div>')
    if s.probs is not None:
        what = f"{s.answer} {dict(s.probs).get(str(s.answer), 0.0):.3f}"
    else:
        what = f"P(yes) {float(s.p_yes or 0.0):.4f} ({s.answer})"
    mark, cls = "", ""
    if a.expected is not None:
        right = s.answer == a.expected
        mark = ("<br><b>right</b>" if right
                else f"<br><b>wrong</b>: expected {e(a.expected)}")
        cls = ' class="right"' if right else ' class="wrong"'
    return (f"<figure{cls}>{pic}<figcaption>{e(s.image_id)}<br>{e(what)}{mark}"
            "</figcaption></figure>")


def _strip(pictures: list[Picture], more: int, item_id: str, kind: str) -> str:
    """A row of small pictures (a clip's frames, a list's images), each titled with what it
    shows ("1.20 s", "image 2"); "+N more" after a list's last shown image."""
    if not pictures:
        return f'<div class="none">{"clip" if kind == "clip" else "images"} unreadable</div>'
    cells = "".join(
        f'<img src="{p.url}" alt="{e(item_id)} {e(p.title)}" title="{e(p.title)}">' if p.url
        else f'<span class="gap" title="{e(p.title)}">?</span>' for p in pictures)
    tail = f'<span class="more">+{more} more</span>' if more else ""
    return f'<div class="strip {kind}">{cells}{tail}</div>'


TICKS = (0.0001, 0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999)  # P(yes) labels


def _histogram(hist: list[int], threshold: float, w: int = 480, h: int = 130) -> str:
    """Bars of the P(yes) counts on the log-odds axis (``bin_of``), ticks in probability,
    the threshold as a red line at its log-odds."""
    top = max(max(hist), 1)
    bw = w / len(hist)

    def x(p: float) -> float:  # a probability's place on the axis
        return (min(max(logit(p), -LOGITS), LOGITS) + LOGITS) / (2 * LOGITS) * w

    bars = "".join(
        f'<rect x="{i * bw + 1:.1f}" y="{h - 32 - (h - 42) * n / top:.1f}" '
        f'width="{bw - 2:.1f}" height="{(h - 42) * n / top:.1f}" fill="#4a78c2">'
        f"<title>P(yes) {_bin_range(i, len(hist))}: {n}</title>"
        "</rect>" for i, n in enumerate(hist))
    ticks = "".join(f'<line x1="{x(p):.1f}" y1="{h - 32}" x2="{x(p):.1f}" y2="{h - 28}" '
                    f'stroke="#667085"/><text x="{x(p):.1f}" y="{h - 17}" font-size="10" '
                    f'text-anchor="middle">{p:g}</text>' for p in TICKS)
    axis = (f'<line x1="0" y1="{h - 32}" x2="{w}" y2="{h - 32}" stroke="#667085"/>{ticks}'
            f'<text x="{w / 2:.0f}" y="{h - 3}" font-size="11" text-anchor="middle">'
            f"P(yes), log-odds axis</text>"
            f'<text x="2" y="10" font-size="11">{top}</text>')
    tx = x(threshold)
    mark = (f'<line x1="{tx:.1f}" y1="0" x2="{tx:.1f}" y2="{h - 32}" stroke="#d33" '
            f'stroke-width="2"><title>threshold {threshold:g}</title></line>')
    return (f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
            f'aria-label="P(yes) histogram">{bars}{axis}{mark}</svg>')


def _bin_range(i: int, bins: int) -> str:
    """Bin ``i``'s P(yes) range as its tooltip says it, ``0.953-0.982``: each end in two
    significant digits of its distance to 0 or 1, whichever is nearer (so the bins near 1
    read ``0.999955-0.999983``, not ``1-1``); the end bins run to 0 and to 1 (``bin_of``
    clamps)."""
    lo = "0" if i == 0 else _prob(sigmoid(i - LOGITS))
    hi = "1" if i == bins - 1 else _prob(sigmoid(i + 1 - LOGITS))
    return f"{lo}-{hi}"


def _prob(p: float) -> str:
    """``p`` in decimals (never ``1e-05``, whose minus would read as a range), to two
    significant digits of its distance to the nearer of 0 and 1."""
    decimals = max(1, 1 - math.floor(math.log10(min(p, 1.0 - p))))
    return f"{p:.{decimals}f}"


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
