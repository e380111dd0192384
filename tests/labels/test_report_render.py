"""``vlmbatch report``'s page rendered in headless Chromium (Debian's ``chromium``; ``.ci/run``
installs it, and these tests skip, saying so, where it is absent): the screenshot is not
blank, the page logs nothing to the console (it runs no script, so any console line is an
error: a failed load, a bad URL), and every thumbnail decodes in the browser. The checks are
shown failing on pages built to fail them.

Two runs per page: ``--screenshot`` with Chromium's log on stderr (console messages appear
there as ``CONSOLE`` lines), and ``--dump-dom`` of a copy with a probe script appended that
writes, once the page has loaded, how many images it has and how many did not decode."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.labels.report_job import make_job
from vlmbatch.labels.report import write_report

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser"))
                 if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on PATH "
                                "(Debian: apt-get install -y chromium; .ci/run does)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--hide-scrollbars"]
PROBE = ("<script>addEventListener('load',()=>{const im=[...document.images];"
         "document.body.setAttribute('data-images',im.length);"
         "document.body.setAttribute('data-broken',"
         "im.filter(i=>!(i.complete&&i.naturalWidth>0)).length)})</script>")


@dataclass(frozen=True)
class Rendered:
    console: list[str]  # console messages the page caused
    screenshot: Path
    images: int
    broken: int  # images that did not decode


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def render(page: Path, tmp: Path, size: tuple[int, int] = (1100, 2400)) -> Rendered:
    shot = tmp / f"{page.stem}.png"
    p = chromium(["--enable-logging=stderr", "--v=0", f"--window-size={size[0]},{size[1]}",
                  f"--screenshot={shot}", page.as_uri()], tmp / "profile-shot")
    assert shot.is_file(), p.stderr[-2000:]
    console = [line for line in p.stderr.splitlines() if re.search(r":CONSOLE[:(]", line)]
    probe = tmp / f"{page.stem}-probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium(["--dump-dom", probe.as_uri()], tmp / "profile-dom").stdout
    counts = {k: int(v) for k, v in re.findall(r'data-(images|broken)="(\d+)"', dom)}
    assert set(counts) == {"images", "broken"}, dom[-2000:]
    return Rendered(console, shot, counts["images"], counts["broken"])


def blank(png: Path) -> bool:
    """True when (nearly) every pixel is the page's most common colour."""
    with Image.open(png) as im:
        px = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(np.int32)
    counts = np.bincount((px[:, 0] << 16) | (px[:, 1] << 8) | px[:, 2])  # one bin per colour
    return counts.max() / len(px) > 0.995 or np.count_nonzero(counts) < 16


def test_the_report_renders(tmp_path: Path) -> None:
    job, _ = make_job(tmp_path, n=24)
    page = tmp_path / "report.html"
    write_report(job, page, borderline=6)
    r = render(page, tmp_path)
    assert r.console == []
    shown = page.read_text().count("<img ")  # borderline and wrong answers' thumbnails
    assert (r.images, r.broken) == (shown, 0) and shown >= 3 * 6
    assert not blank(r.screenshot)
    with Image.open(r.screenshot) as im:
        assert im.size == (1100, 2400)


def test_the_checks_fail_on_pages_built_to_fail_them(tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><p>x</p><img src=\"data:image/png;base64,AAAA\">"
                   "<script>undefinedFunction()</script></body></html>")
    r = render(bad, tmp_path)
    assert any("undefinedFunction" in line for line in r.console), r.console
    assert (r.images, r.broken) == (1, 1)
    empty = tmp_path / "empty.html"
    empty.write_text("<!DOCTYPE html><html><body style=\"background:#fff\"></body></html>")
    assert blank(render(empty, tmp_path).screenshot)
