"""Clips for the video tests, made here with PyAV (never downloaded): lossless codecs, so
every decoder gives back exactly the frames drawn, which are the tests' expected pixels."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

# (container, codec, pixel format, options): each lossless for RGB input
FFV1_MKV = ("matroska", "ffv1", "bgr0", {})
X264_MP4 = ("mp4", "libx264rgb", "rgb24", {"qp": "0", "g": "5", "bf": "2"})  # GOPs, B-frames


def frame(i: int, w: int, h: int) -> np.ndarray:
    """Frame ``i``: noise seeded by ``i`` with ``i`` written in its first pixels: distinct."""
    img = np.random.default_rng(1000 + i).integers(0, 256, (h, w, 3), dtype=np.uint8)
    img[0, :4, 0] = np.frombuffer(np.uint32(i).tobytes(), np.uint8)
    return img


def frames(n: int, w: int, h: int) -> np.ndarray:
    return np.stack([frame(i, w, h) for i in range(n)])


def make_clip(pixels: np.ndarray, kind: tuple = FFV1_MKV, rate: int = 25,
              pts: list[int] | None = None, time_base: Fraction | None = None,
              rotation: float | None = None) -> bytes:
    """Encode ``pixels`` [T, H, W, 3]; ``pts`` in ``time_base`` units (variable frame rate),
    else frame ``i`` at ``i / rate``; ``rotation``: a display matrix (degrees, counter-
    clockwise, as FFmpeg writes it)."""
    fmt, codec, pix, options = kind
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=Fraction(rate, 1), options=dict(options))
        s.width, s.height, s.pix_fmt = pixels.shape[2], pixels.shape[1], pix
        if time_base is not None:
            s.codec_context.time_base = time_base
            s.time_base = time_base
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i, img in enumerate(pixels):
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts = pts[i] if pts is not None else i
            if time_base is not None:
                f.time_base = time_base
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def decode_all(data: bytes) -> tuple[np.ndarray, list[float]]:
    """Every frame, decoded in order (the slow way the decoder is checked against), rotation
    not applied, and each frame's time."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        got = [(f.to_ndarray(format="rgb24"), float(f.pts * s.time_base))
               for f in c.decode(s)]
    return np.stack([g[0] for g in got]), [g[1] for g in got]
