"""What decoding a clip as sampled saves (``preprocessing/video.py``), side by side in one
process, and the memory a long clip costs.

Speed: a generated 1080p H.264 clip (``--seconds`` at 30 fps, a key frame every 2 s, as
phones and encoders' defaults make them), sampled as Qwen2-VL samples it at 2 fps (4 frames
in each key-frame interval: seeking can skip little) and as InternVL samples 8 frames
(sparse: most of each interval skipped); the sampled frames decoded three ways: seek-as-
sampled (``Clip.frames``), decode everything then index (every frame converted to RGB, as
transformers' and vLLM's PyAV readers do), and decode everything but convert only the
sampled frames (the cheapest decode-all). Each ``--repeats`` times, alternating; the median
wall time, sampled frames per second of each, and the ratio.

Memory: a ``--long-seconds`` 1080p clip at ``--long-fps`` prepared whole by a Qwen2-VL
``VideoPlan`` (``--long-frames`` sampled frames, rows at its default pixel bound), in a
fresh process: peak RSS (VmHWM) minus RSS once the clip's bytes are read (the input bytes
themselves are not counted; they are the file's size, printed).

    python bench/video_decode.py [--seconds 20] [--long-seconds 600]

Not a test: timings on shared machines are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlmbatch.preprocessing.video import open_clip  # noqa: E402
from vlmbatch.preprocessing.video_sampling import VideoSampling  # noqa: E402

W, H = 1920, 1080


def make_clip(seconds: float, fps: int, path: Path) -> None:
    """A moving gradient with a moving block: compresses like filmed content, cheap to make."""
    y, x = np.mgrid[0:H, 0:W]
    base = np.stack([(x // 8) % 256, (y // 8) % 256, ((x + y) // 16) % 256], -1).astype(np.uint8)
    with av.open(str(path), "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=Fraction(fps, 1),
                         options={"preset": "ultrafast", "g": str(2 * fps), "crf": "23"})
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        for i in range(int(seconds * fps)):
            img = np.roll(base, 4 * i, axis=1)
            img[(i * 7) % (H - 100):][:100, (i * 13) % (W - 100):][:, :100] = 255 - img[0, 0]
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts = i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def decode_all(data: bytes, idx: np.ndarray, convert_all: bool) -> np.ndarray:
    want = set(int(i) for i in idx)
    with av.open(io.BytesIO(data)) as c:
        got = {}
        for k, f in enumerate(c.decode(c.streams.video[0])):
            if convert_all or k in want:
                rgb = f.to_ndarray(format="rgb24")
                if k in want:
                    got[k] = rgb
    return np.stack([got[int(i)] for i in idx])


DECODED: list[int] = []  # frames the seeking decoder output, per call


def seek(data: bytes, idx: np.ndarray) -> np.ndarray:
    with open_clip(data, 10**9) as clip:
        pixels = clip.frames(idx).pixels
        DECODED.append(clip.decoded)
        return pixels


def speed(seconds: float, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "clip.mp4"
        make_clip(seconds, 30, path)
        data = path.read_bytes()
    with open_clip(data, 10**9) as clip:
        info = clip.info
    print(f"clip: {W}x{H}, {info.total_frames} frames at {info.fps:g} fps, "
          f"{len(data) / 1e6:.1f} MB")
    for name, sampling in (("Qwen2-VL, 2 fps", VideoSampling("qwen2_vl", fps=2.0)),
                           ("InternVL, 8 frames", VideoSampling("internvl", fps=None,
                                                                num_frames=8))):
        idx = sampling.indices(info)
        print(f" sampled {len(idx)} frames ({name})")
        compare(data, idx, repeats)


def compare(data: bytes, idx: np.ndarray, repeats: int) -> None:
    ways = {"seek as sampled": lambda: seek(data, idx),
            "decode all, convert all": lambda: decode_all(data, idx, True),
            "decode all, convert sampled": lambda: decode_all(data, idx, False)}
    ref = seek(data, idx)
    print(f"  seek decodes {DECODED[-1]} frames of the clip's {len(ref) and _total(data)} "
          "(decode-all: every one)")
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            assert np.array_equal(out, ref), name  # the same frames every way
    base = statistics.median(times["seek as sampled"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:28s} {m:7.3f} s  {len(idx) / m:7.1f} sampled frames/s  "
              f"x{m / base:.2f} of seek")


def _total(data: bytes) -> int:
    with open_clip(data, 10**9) as clip:
        return clip.info.total_frames


CHILD = """
import sys, resource
from pathlib import Path
sys.path.insert(0, {root!r})
from vlmbatch.preprocessing.qwen_vl import QwenVLPreprocess
from vlmbatch.preprocessing.video_plan import VideoPlan
from vlmbatch.preprocessing.video_rows import QwenVideoLayout
from vlmbatch.preprocessing.video_sampling import VideoSampling

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
data = Path({path!r}).read_bytes()
plan = VideoPlan(VideoSampling("qwen2_vl", fps=None, num_frames={frames}),
                 QwenVideoLayout(QwenVLPreprocess(min_pixels=128 * 28 * 28,
                                                  max_pixels=28 * 28 * 768)))
before = rss("VmRSS")
v = plan.prepare(data, 10**9)
print(f"{{rss('VmHWM') - before:.0f}} {{v.rows.nbytes / 2**20:.0f}} {{len(v.frame_indices)}}")
"""


def memory(seconds: float, fps: int, frames: int) -> float:
    """Prints the long clip's figures; returns the RSS growth in MiB (``bench/video.py``)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "long.mp4"
        t0 = time.perf_counter()
        make_clip(seconds, fps, path)
        made = time.perf_counter() - t0
        code = CHILD.format(root=str(Path(__file__).resolve().parents[1]), path=str(path),
                            frames=frames)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True).stdout.split()
        took = time.perf_counter() - t0
        size = path.stat().st_size
    growth, rows, n = out
    print(f"long clip: {W}x{H}, {seconds:g} s at {fps} fps ({int(seconds * fps)} frames, "
          f"{size / 1e6:.0f} MB, made in {made:.0f} s); prepared {n} frames in {took:.1f} s: "
          f"RSS growth {growth} MiB (rows {rows} MiB of it)")
    return float(growth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-seconds", type=float, default=600.0)
    ap.add_argument("--long-fps", type=int, default=30)
    ap.add_argument("--long-frames", type=int, default=32)
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}, {os.cpu_count()} CPUs, PyAV {av.__version__}")
    speed(a.seconds, a.repeats)
    if a.long_seconds > 0:
        memory(a.long_seconds, a.long_fps, a.long_frames)


if __name__ == "__main__":
    main()
