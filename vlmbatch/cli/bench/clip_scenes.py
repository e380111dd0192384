"""Multi-frame shape cases: clips and image lists of ``shapes.py`` scenes, each with presence
questions whose answer is *yes* iff some frame (or image) has the attribute.

Shared by the built-in model's training (``scripts/train_default_model.py``,
``--multi-frame``) and its evaluation (``bench/clip_accuracy.py``), which draw from
different seeds. Scenes come from ``make_scene`` only (a *no* case draws scenes by rejection
until none has the attribute), so clips and images look like the single-image training data.

Invariants: a case's ``questions[0]`` is the built one (half *yes*, of those half with the
attribute in exactly one scene: ``needle``); every answer is computed from the scenes.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import av  # the clips' writer (PyAV ships FFmpeg); only training and bench/ import this
import numpy as np

from vlmbatch.cli.bench.shapes import COLORS, SHAPES, Scene, make_scene

KINDS = ("colour", "shape", "both")
HOLD = 2  # frames of an encoded clip per scene


@dataclass(frozen=True)
class Attribute:
    """A presence question's subject: a colour, a shape kind, or both."""
    color: str | None
    kind: str | None

    @property
    def text(self) -> str:
        """The question as the evaluation and the README ask it."""
        if self.kind is None:
            return f"Is there a {self.color} shape?"
        return f"Is there a {self.color} {self.kind}?" if self.color else f"Is there a {self.kind}?"

    @property
    def family(self) -> str:
        return "both" if self.color and self.kind else "colour" if self.color else "shape"

    def in_scene(self, scene: Scene) -> bool:
        return any((self.color is None or s.color == self.color)
                   and (self.kind is None or s.kind == self.kind) for s in scene.shapes)


@dataclass(frozen=True)
class Case:
    """Scenes in order (a clip's frames or an item's images) and (attribute, truth) pairs."""
    scenes: tuple[Scene, ...]
    questions: tuple[tuple[Attribute, bool], ...]
    needle: bool


def random_attribute(rng: np.random.Generator) -> Attribute:
    family = KINDS[int(rng.integers(len(KINDS)))]
    color = str(rng.choice(list(COLORS))) if family != "shape" else None
    kind = str(rng.choice(SHAPES)) if family != "colour" else None
    return Attribute(color, kind)


def scene_where(rng: np.random.Generator, attr: Attribute, present: bool, max_shapes: int,
                size: tuple[int, int] | None) -> Scene:
    """A ``make_scene`` draw that has (or lacks) ``attr``, by rejection."""
    while True:
        scene = make_scene(rng, max_shapes, size)
        if attr.in_scene(scene) == present:
            return scene


def clip_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of a clip's frames, even, drawn as ``make_scene`` draws sizes (up to
    1:2)."""
    short = int(rng.integers(48, 200))
    long_ = min(int(short * rng.choice([1.0, 1.0, 1.33, 1.5, 2.0])), 400)
    w, h = (short, long_) if rng.random() < 0.5 else (long_, short)
    return w // 2 * 2, h // 2 * 2


def make_case(rng: np.random.Generator, frames: int, same_size: bool, extra: int = 3,
              max_shapes: int = 2) -> Case:
    """One case (module docstring): a built question, then ``extra`` random ones."""
    size = clip_size(rng) if same_size else None
    attr = random_attribute(rng)
    yes = bool(rng.random() < 0.5)
    holders: set[int] = set()
    if yes:
        k = 1 if rng.random() < 0.5 else int(rng.integers(1, frames + 1))
        holders = {int(i) for i in rng.choice(frames, k, replace=False)}
    scenes = tuple(scene_where(rng, attr, i in holders, max_shapes, size) for i in range(frames))
    questions = [(attr, yes)]
    for _ in range(extra):
        a = random_attribute(rng)
        questions.append((a, any(a.in_scene(s) for s in scenes)))
    return Case(scenes, tuple(questions), yes and len(holders) == 1)


def make_cases(n: int, frames: int, same_size: bool, seed: int, extra: int = 3) -> list[Case]:
    """``n`` cases of ``frames`` scenes, one size per case if ``same_size`` (a clip)."""
    rng = np.random.default_rng([seed, frames, int(same_size)])
    return [make_case(rng, frames, same_size, extra) for _ in range(n)]


def encode_clip(case: Case, hold: int = HOLD) -> bytes:
    """The case's scenes as a lossless clip (FFV1 in Matroska, 2 fps), each held ``hold``
    frames: decoders give back exactly the scenes' pixels."""
    return encode_frames((sc.image for sc in case.scenes for _ in range(hold)), 2)


def encode_frames(frames: Iterable[np.ndarray], fps: int) -> bytes:
    """uint8 RGB frames ``[H, W, 3]`` (one size) as a lossless clip: FFV1 in Matroska at
    ``fps``, frame ``i`` at ``i / fps``, so that decoders give back exactly these pixels."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("ffv1", rate=Fraction(fps, 1))
        for i, img in enumerate(frames):
            if i == 0:
                s.height, s.width = img.shape[:2]
                s.pix_fmt = "bgr0"
            f = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            f.pts = i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()
