"""A generated corpus of bad images (built here, never committed): every one must end as a
``PreparedImage`` or an ``ImageError``, never another exception, never a crash of the process,
in bounded time.

Classes: valid PNG/JPEG/WebP/GIF/BMP/TIFF files (OpenCV and Pillow encoders, with alpha,
palette, 16-bit, CMYK, EXIF rotation, animation, several pages) cut at every 10% of their
length; the same with their bytes after the headers replaced by random ones or with bytes
flipped; random bytes behind the magic number of every format OpenCV or Pillow might
recognise; headers that lie about the size (PNG IHDR, JPEG SOF, GIF screen, BMP, TIFF,
WebP); a zero-byte file, 1x1 images, 1xN and Nx1 extremes; a 280 KB PNG of 10000x10000
pixels (the --max-pixels limit exactly) and one pixel row more. The corpus is decoded in a child
process (``prepare_bytes``, the built-in model's 112-px tiles, reduced tiling), so a segfault
is a negative return code naming the image it died on, not a dead pytest. The last test runs
``vlmbatch run`` over a manifest of bad images and two good ones.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from collections import Counter
from functools import lru_cache
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
TILE = 112  # the built-in model's tile size
SECONDS_PER_IMAGE = 10.0  # generous on a shared 2-core machine; most take under 10 ms


def smooth(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)
    return cv2.GaussianBlur(img, (7, 7), 3)


def cv_encode(ext: str, img: np.ndarray, *params: int) -> bytes:
    ok, buf = cv2.imencode(ext, img, list(params))
    assert ok, ext
    return buf.tobytes()


def pil_encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def valid_images() -> dict[str, bytes]:
    a = smooth()
    p = Image.fromarray(a)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 to display
    return {
        "png": cv_encode(".png", a),
        "png_rgba": cv_encode(".png", cv2.cvtColor(a, cv2.COLOR_RGB2BGRA)),
        "png_16bit": cv_encode(".png", a.astype(np.uint16) * 257),
        "png_palette": pil_encode(p.convert("P"), "PNG"),
        "png_gray_alpha": pil_encode(p.convert("LA"), "PNG"),
        "jpeg": cv_encode(".jpg", a, cv2.IMWRITE_JPEG_QUALITY, 90),
        "jpeg_progressive": pil_encode(p, "JPEG", quality=90, progressive=True),
        "jpeg_cmyk": pil_encode(p.convert("CMYK"), "JPEG", quality=90),
        "jpeg_exif_rotated": pil_encode(p, "JPEG", quality=90, exif=exif.tobytes()),
        "jpeg_large": cv_encode(".jpg", cv2.resize(a, (1600, 1200)), cv2.IMWRITE_JPEG_QUALITY, 80),
        "webp": cv_encode(".webp", a, cv2.IMWRITE_WEBP_QUALITY, 80),
        "webp_lossless_rgba": pil_encode(p.convert("RGBA"), "WEBP", lossless=True),
        "gif": pil_encode(p.convert("P"), "GIF"),
        "gif_animated": pil_encode(p.convert("P"), "GIF", save_all=True,
                                   append_images=[Image.fromarray(255 - a).convert("P")]),
        "bmp": cv_encode(".bmp", a),
        "tiff": cv_encode(".tiff", a),
        "tiff_pages": pil_encode(p, "TIFF", save_all=True, append_images=[p.convert("L")],
                                 compression="tiff_deflate"),
    }


MAGICS = {
    "png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff\xe0", "jpeg_sof": b"\xff\xd8\xff\xc0",
    "gif87": b"GIF87a", "gif89": b"GIF89a", "bmp": b"BM", "tiff_le": b"II*\x00",
    "tiff_be": b"MM\x00*", "webp_vp8": b"RIFF\x00\x10\x00\x00WEBPVP8 ",
    "webp_vp8l": b"RIFF\x00\x10\x00\x00WEBPVP8L", "webp_vp8x": b"RIFF\x00\x10\x00\x00WEBPVP8X",
    "ppm": b"P6\n", "pgm": b"P5\n", "pbm": b"P4\n", "pfm": b"PF\n", "pam": b"P7\n",
    "hdr": b"#?RADIANCE\n", "exr": b"v/1\x01", "jp2": b"\x00\x00\x00\x0cjP  \r\n\x87\n",
    "j2k": b"\xff\x4f\xff\x51", "sunras": b"\x59\xa6\x6a\x95", "ico": b"\x00\x00\x01\x00",
    "psd": b"8BPS", "avif": b"\x00\x00\x00\x1cftypavif",
}


def png_with_ihdr(w: int, h: int, fix_crc: bool, depth: int = 8, color: int = 2,
                  base: bytes | None = None) -> bytes:
    data = bytearray(base or cv_encode(".png", smooth(4, 4)))
    data[16:26] = struct.pack(">IIBB", w, h, depth, color)
    if fix_crc:
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def jpeg_with_sof(w: int, h: int) -> bytes:
    data = bytearray(cv_encode(".jpg", smooth()))
    i = data.find(b"\xff\xc0")
    data[i + 5:i + 9] = struct.pack(">HH", h, w)
    return bytes(data)


def gif_with_screen(w: int, h: int, frame_too: bool) -> bytes:
    data = bytearray(pil_encode(Image.fromarray(smooth()).convert("P"), "GIF"))
    data[6:10] = struct.pack("<HH", w, h)
    if frame_too:  # the image descriptor: 0x2C, left, top, width, height
        i = data.find(b"\x2c\x00\x00\x00\x00")
        data[i + 5:i + 9] = struct.pack("<HH", w, h)
    return bytes(data)


def bmp_with_size(w: int, h: int) -> bytes:
    data = bytearray(cv_encode(".bmp", smooth()))
    data[18:26] = struct.pack("<ii", w, h)
    return bytes(data)


def tiff_gray(w: int, h: int, pixels: bytes) -> bytes:
    """A minimal uncompressed 8-bit gray TIFF whose header says ``w`` x ``h``."""
    entries = [(256, 4, w), (257, 4, h), (258, 3, 8), (259, 3, 1), (262, 3, 1),
               (273, 4, 0), (277, 3, 1), (278, 4, h), (279, 4, len(pixels))]
    ifd_at = 8
    data_at = ifd_at + 2 + 12 * len(entries) + 4
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHII", tag, typ, 1, data_at if tag == 273 else value)
        if typ == 4 else struct.pack("<HHIHH", tag, typ, 1, value, 0)
        for tag, typ, value in entries) + b"\x00\x00\x00\x00"
    return b"II*\x00" + struct.pack("<I", ifd_at) + ifd + pixels


def webp_with_size(w: int, h: int) -> bytes:
    data = bytearray(cv_encode(".webp", smooth(), cv2.IMWRITE_WEBP_QUALITY, 80))
    i = data.find(b"\x9d\x01\x2a")  # VP8 key frame start code, then 14-bit width, height
    data[i + 3:i + 7] = struct.pack("<HH", w & 0x3FFF, h & 0x3FFF)
    return bytes(data)


def png_flat(w: int, h: int) -> bytes:
    """A black ``w`` x ``h`` PNG, compressed row by row (never ``w * h`` bytes in memory)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    z = zlib.compressobj(9)
    row = bytes(1 + 3 * w)  # filter byte 0, then RGB zeros
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


# name -> (bytes, expected: "prepared", "error" or "either")
Corpus = dict[str, tuple[bytes, str]]


@lru_cache(maxsize=1)
def corpus() -> Corpus:
    bomb = png_flat(10_000, 10_000)  # 100 MP, as many as --max-pixels allows by default
    return {**build_corpus(), "bomb_10000x10000": (bomb, "prepared"),
            "bomb_10000x10001": (png_with_ihdr(10_000, 10_001, True, base=bomb), "error")}


def build_corpus() -> Corpus:
    out: Corpus = {}
    rng = np.random.default_rng(0)
    for name, data in valid_images().items():
        for tenth in range(11):  # 0%, 10%, ... 100% of the file
            cut = data[: len(data) * tenth // 10]
            # a cut PNG misses its IEND chunk or its last IDAT's CRC: libpng refuses it
            partial = "error" if name.startswith("png") else "either"
            out[f"cut_{name}_{tenth * 10:03d}"] = (
                cut, "prepared" if tenth == 10 else "error" if tenth == 0 else partial)
        head = min(len(data) // 4, 64)  # the headers, then noise
        out[f"noise_after_header_{name}"] = (
            data[:head] + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "either")
        for seed in range(3):
            flipped = np.frombuffer(data, np.uint8).copy()
            at = np.random.default_rng(seed).integers(head, len(data), 8)
            flipped[at] ^= np.uint8(0xFF)
            out[f"flipped_{name}_{seed}"] = (flipped.tobytes(), "either")
    for name, magic in MAGICS.items():
        for seed in range(3):
            for size in (64, 4096):
                noise = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
                out[f"magic_{name}_{size}_{seed}"] = (magic + noise.tobytes(), "either")
    out.update(lying_headers())
    out.update(tiny_and_extreme())
    return out


def lying_headers() -> Corpus:
    over = "error"  # over --max-pixels (100 MP): the bomb guard refuses before decoding
    out: Corpus = {}
    for w, h in [(100_000, 100_000), (2**31 - 1, 1), (65535, 65535)]:
        out[f"png_ihdr_{w}x{h}"] = (png_with_ihdr(w, h, True), over)
        out[f"png_ihdr_{w}x{h}_bad_crc"] = (png_with_ihdr(w, h, False), "error")
    # in the limit (1 x 10^8 just so), but no such pixels in the file
    for w, h in [(0, 0), (0, 10), (10_000, 10_000), (10_000, 1), (1, 100_000_000)]:
        out[f"png_ihdr_{w}x{h}"] = (png_with_ihdr(w, h, True), "error")
    out["png_ihdr_1x100000000_bad_crc"] = (png_with_ihdr(1, 100_000_000, False), "error")
    out["png_ihdr_bad_depth"] = (png_with_ihdr(4, 4, True, depth=3, color=7), "error")
    out["png_ihdr_2**32-1"] = (png_with_ihdr(2**32 - 1, 2**32 - 1, True), "error")
    for w, h in [(65535, 65535), (60000, 60000)]:
        out[f"jpeg_sof_{w}x{h}"] = (jpeg_with_sof(w, h), over)
    for w, h in [(0, 0), (0, 48), (64, 0), (8000, 8000), (10_000, 10_000), (60000, 1),
                 (1, 60000), (65535, 1)]:
        out[f"jpeg_sof_{w}x{h}"] = (jpeg_with_sof(w, h), "either")
    for w, h in [(65535, 65535), (0, 0), (1, 65535)]:
        for frame in (False, True):
            out[f"gif_screen_{w}x{h}{'_frame' if frame else ''}"] = (
                gif_with_screen(w, h, frame), "either")
    for w, h in [(100_000, 100_000), (2**31 - 1, 2**31 - 1), (1, -100_000), (-64, 48), (0, 0),
                 (64, -(2**31))]:
        out[f"bmp_{w}x{h}"] = (bmp_with_size(w, h), "either")
    out["bmp_100000x100000"] = (bmp_with_size(100_000, 100_000), over)
    for w, h in [(100_000, 100_000), (2**32 - 1, 2**32 - 1)]:
        out[f"tiff_{w}x{h}"] = (tiff_gray(w, h, b"\x80" * 16), over)
    for w, h in [(9000, 9000), (0, 0), (1, 1_000_000), (4, 4)]:
        out[f"tiff_{w}x{h}"] = (tiff_gray(w, h, b"\x80" * 16), "prepared" if w == 4 else "either")
    for w, h in [(16383, 16383), (0, 0), (16383, 1)]:
        out[f"webp_{w}x{h}"] = (webp_with_size(w, h), over if w * h > 10**8 else "either")
    return out


def tiny_and_extreme() -> Corpus:
    out: Corpus = {"zero_bytes": (b"", "error")}
    one = smooth(1, 1)
    for ext in (".png", ".jpg", ".webp", ".bmp", ".tiff"):
        out[f"1x1{ext}"] = (cv_encode(ext, one), "prepared")
    out["1x1.gif"] = (pil_encode(Image.fromarray(one).convert("P"), "GIF"), "prepared")
    for w, h in [(1, 10_000), (10_000, 1), (2, 30_000)]:
        strip = cv2.resize(smooth(), (w, h), interpolation=cv2.INTER_NEAREST)
        out[f"{w}x{h}.png"] = (cv_encode(".png", strip), "prepared")
        out[f"{w}x{h}.jpg"] = (cv_encode(".jpg", strip), "prepared")
    out["1x16383.webp"] = (cv_encode(".webp", cv2.resize(smooth(), (1, 16383))), "prepared")
    out["1x10000.gif"] = (pil_encode(Image.fromarray(cv2.resize(smooth(), (1, 10_000)))
                                     .convert("P"), "GIF"), "prepared")
    return out


# Runs in a child: prepare_bytes on every *.img in a folder; a JSON line per image on
# stdout (name, outcome, detail, seconds), the name written to stderr first so a crash
# names its image.
CHILD = r"""
import json, sys, time, traceback
from pathlib import Path
from vlmbatch.preprocessing.decode import DEFAULT_MAX_PIXELS, ImageError
from vlmbatch.preprocessing.prepare import PreparedImage, TilingConfig, prepare_bytes
cfg = TilingConfig(tile_size=int(sys.argv[2]), mode="reduced")
for path in sorted(Path(sys.argv[1]).glob("*.img")):
    print("decoding", path.name, file=sys.stderr, flush=True)
    data = path.read_bytes()
    t = time.perf_counter()
    try:
        p = prepare_bytes(data, cfg, DEFAULT_MAX_PIXELS)
        good = (isinstance(p, PreparedImage) and p.tiles.dtype.name == "uint8"
                and p.tiles.shape[1:] == (cfg.tile_size, cfg.tile_size, 3)
                and p.tiles.shape[0] == p.grid.num_tiles and p.width > 0 and p.height > 0)
        res = ("prepared" if good else "malformed", f"{p.width}x{p.height}, {len(p.tiles)} tiles")
    except ImageError as e:
        res = ("ImageError", str(e)[:200])
    except BaseException as e:
        res = ("other", traceback.format_exc()[-800:])
    print(json.dumps([path.name, *res, time.perf_counter() - t]), flush=True)
"""


def run_child(folder: Path, timeout: float) -> dict[str, tuple[str, str, float]]:
    """Outcomes by file name; a crash (negative return code: the signal) or a hang of the
    child fails here, naming the image it was on."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(TILE)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        last = [ln for ln in err.splitlines() if ln.startswith("decoding ")][-1:]
        pytest.fail(f"decoder process hung ({timeout}s) on {last}")
    last = [ln for ln in proc.stderr.splitlines() if ln.startswith("decoding ")][-1:]
    assert proc.returncode == 0, (f"decoder process died (return code {proc.returncode}) on "
                                  f"{last}: {proc.stderr[-2000:]}")
    return {name: (outcome, detail, seconds) for name, outcome, detail, seconds
            in map(json.loads, proc.stdout.splitlines())}


def write_corpus(folder: Path, cases: Corpus) -> None:
    folder.mkdir()
    for name, (data, _) in cases.items():
        (folder / f"{name}.img").write_bytes(data)


def test_every_bad_image_is_prepared_or_an_image_error(tmp_path: Path) -> None:
    cases = corpus()
    write_corpus(tmp_path / "corpus", cases)
    got = run_child(tmp_path / "corpus", timeout=600)
    assert set(got) == {f"{n}.img" for n in cases}, "an image has no outcome"
    wrong = {n: g for n, g in got.items() if g[0] not in ("prepared", "ImageError")}
    assert not wrong, wrong  # another exception, or a PreparedImage that breaks its invariants
    slow = {n: g for n, g in got.items() if g[2] > SECONDS_PER_IMAGE}
    assert not slow, slow
    for name, (_, expected) in cases.items():
        outcome = got[f"{name}.img"][0]
        if expected != "either":
            assert outcome == ("prepared" if expected == "prepared" else "ImageError"), \
                (name, got[f"{name}.img"])
    counts = Counter(outcome for outcome, _, _ in got.values())
    # docs/reliability.md and docs/status.md: 461 files, 59 prepared, 402 ImageError (a change to
    # the corpus or to what a case becomes changes those figures too)
    assert (len(cases), counts["prepared"], counts["ImageError"]) == (461, 59, 402), counts


def e2e_images() -> dict[str, bytes]:
    """30 images that must fail (empty, cut, lying headers of each format) and 2 good ones."""
    cases = build_corpus()
    pick = ["zero_bytes", *(f"cut_png_{p:03d}" for p in range(10, 100, 10)),
            "jpeg_sof_65535x65535", "jpeg_sof_60000x60000", "bmp_100000x100000",
            "tiff_100000x100000", "tiff_4294967295x4294967295", "webp_16383x16383",
            *sorted(n for n in cases if n.startswith("png_ihdr"))]
    assert all(cases[n][1] == "error" for n in pick), pick
    images = {n: cases[n][0] for n in pick}
    images.update({"good_png": cases["cut_png_100"][0], "good_jpeg": cases["cut_jpeg_100"][0]})
    return images


def test_run_over_bad_images(tmp_path: Path) -> None:
    """Every (image, question) line once; the bad images' lines carry an error, the good ones
    an answer; exit code 3 (some images failed); no traceback."""
    images = e2e_images()
    assert len(images) == 32
    (tmp_path / "img").mkdir()
    lines = []
    for name, data in images.items():
        (tmp_path / "img" / f"{name}.img").write_bytes(data)
        lines.append(json.dumps({"id": name, "image": f"img/{name}.img"}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "vlmbatch", "run", str(tmp_path / "m.jsonl"), "--policy",
         str(ROOT / "examples" / "policy.yaml"), "--no-progress", "-o", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    keys = Counter((r["id"], r["question_id"]) for r in rows)
    assert keys == Counter({(n, q): 1 for n in images for q in ("red", "circle", "several")})
    for r in rows:
        if r["id"].startswith("good_"):
            assert r["error"] is None and r["answer"] in ("yes", "no"), r
        else:
            assert r["error"] and r["answer"] is None, r


def test_a_crash_in_the_decoder_fails_the_test_not_pytest(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness: a decoder that segfaults on one image (simulated: ctypes reads address 0)
    is a failed assertion naming that image."""
    crash = CHILD.replace("    data = path.read_bytes()\n", "    data = path.read_bytes()\n"
                          "    if path.name == 'b.img':\n"
                          "        import ctypes; ctypes.string_at(0)\n")
    assert crash != CHILD
    monkeypatch.setattr(sys.modules[__name__], "CHILD", crash)
    write_corpus(tmp_path / "c", {"a": (b"", "error"), "b": (b"", "error"), "c": (b"", "error")})
    with pytest.raises(AssertionError, match=r"died \(return code -11\) on \['decoding b\.img'\]"):
        run_child(tmp_path / "c", timeout=60)


def test_corpus_is_deterministic() -> None:
    """The same bytes every run (seeded noise, fixed encoders), so CI sees the same cases."""
    assert build_corpus() == build_corpus()
