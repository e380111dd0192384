"""Shape-scene generator: the project's own training and example data.

A scene is a light background with 1-3 non-overlapping filled shapes (circle, rectangle,
triangle) in the eight colours easy-vqa uses. Canvas sizes and aspect ratios vary widely so
that InternVL dynamic tiling produces 1 to several tiles. Each scene comes with yes/no
questions about presence, colour, count and position, balanced between yes and no.

Everything is drawn with OpenCV from a seeded ``numpy.random.Generator``: the same seed gives
the same scenes on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

# RGB; the palette easy-vqa's train images use (read off their pixels), so that what the
# model learns about colour words on our scenes holds on easy-vqa images too.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "teal": (0, 128, 128),
    "yellow": (255, 255, 0),
    "brown": (165, 42, 42),
}
SHAPES = ("circle", "rectangle", "triangle")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    cx: float  # centre, pixels
    cy: float
    r: float  # half-size, pixels


@dataclass(frozen=True)
class Scene:
    image: np.ndarray  # [H, W, 3] uint8 RGB
    shapes: tuple[Shape, ...]


def _draw(img: np.ndarray, s: Shape, rng: np.random.Generator) -> None:
    col = COLORS[s.color]
    cx, cy, r = int(s.cx), int(s.cy), int(s.r)
    if s.kind == "circle":
        cv2.circle(img, (cx, cy), r, col, -1, cv2.LINE_AA)
    elif s.kind == "rectangle":
        aspect = rng.uniform(0.55, 1.0)
        w, h = (r, int(r * aspect)) if rng.random() < 0.5 else (int(r * aspect), r)
        cv2.rectangle(img, (cx - w, cy - h), (cx + w, cy + h), col, -1, cv2.LINE_AA)
    else:
        pts = np.array([[cx, cy - r], [cx - r, cy + int(0.8 * r)], [cx + r, cy + int(0.8 * r)]])
        cv2.fillPoly(img, [pts.astype(np.int32)], col, cv2.LINE_AA)


def make_scene(rng: np.random.Generator, max_shapes: int = 3,
               size: tuple[int, int] | None = None) -> Scene:
    """One random scene; canvas 48..400 px a side, aspect ratio up to 1:4, or ``size``
    (width, height) when given (then the rng draws no size: the default's draws are
    unchanged)."""
    if size is None:
        short = int(rng.integers(48, 200))
        long_ = int(short * rng.choice([1.0, 1.0, 1.33, 1.5, 2.0, 3.0, 4.0]))
        long_ = min(long_, 400)
        h, w = (short, long_) if rng.random() < 0.5 else (long_, short)
    else:
        w, h = size
    bg = rng.integers(200, 256, size=3)
    img = np.empty((h, w, 3), np.uint8)
    img[:] = bg
    n = int(rng.integers(1, max_shapes + 1))
    shapes: list[Shape] = []
    for _ in range(40 * n):
        if len(shapes) == n:
            break
        r = rng.uniform(0.12, 0.45 if n == 1 else 0.25) * min(h, w)
        cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
        if all((cx - o.cx) ** 2 + (cy - o.cy) ** 2 > (r + o.r + 2) ** 2 for o in shapes):
            shapes.append(Shape(str(rng.choice(SHAPES)), str(rng.choice(list(COLORS))), cx, cy, r))
    for s in shapes:
        _draw(img, s, rng)
    return Scene(img, tuple(shapes))


def _presence(scene: Scene, rng: np.random.Generator) -> tuple[str, bool]:
    color = str(rng.choice(list(COLORS)))
    kind = str(rng.choice(SHAPES))
    form = int(rng.integers(0, 3))
    if form == 0:
        truth = any(s.color == color for s in scene.shapes)
        target = f"{color} shape"
    elif form == 1:
        truth = any(s.kind == kind for s in scene.shapes)
        target = kind
    else:
        truth = any(s.kind == kind and s.color == color for s in scene.shapes)
        target = f"{color} {kind}"
    if rng.random() < 0.3:
        return f"is there not a {target} in the image?", not truth
    return str(rng.choice([f"is there a {target}?", f"does the image contain a {target}?",
                           f"is there a {target} in the image?"])), truth


def _count(scene: Scene, rng: np.random.Generator) -> tuple[str, bool]:
    k = int(rng.integers(1, 4))
    if rng.random() < 0.5:
        return f"are there {COUNT_WORDS[k]} shapes?", len(scene.shapes) == k
    return "is there more than one shape?", len(scene.shapes) > 1


def _position(scene: Scene, rng: np.random.Generator) -> tuple[str, bool]:
    s = scene.shapes[int(rng.integers(0, len(scene.shapes)))]
    h, w = scene.image.shape[:2]
    side = str(rng.choice(["left", "right", "top", "bottom"]))
    truth = {"left": s.cx < w / 2, "right": s.cx >= w / 2,
             "top": s.cy < h / 2, "bottom": s.cy >= h / 2}[side]
    return f"is the {s.color} {s.kind} in the {side} half?", truth


def make_questions(scene: Scene, rng: np.random.Generator, k: int) -> list[tuple[str, str]]:
    """k (question, "yes"/"no") pairs, balanced by rejection where possible."""
    out: list[tuple[str, str]] = []
    want_yes = bool(rng.random() < 0.5)
    for _ in range(20 * k):
        if len(out) == k:
            break
        gen = rng.choice([_presence, _presence, _presence, _count, _position])  # type: ignore[arg-type]
        q, truth = gen(scene, rng)
        if truth != want_yes and rng.random() < 0.8:
            continue
        out.append((q, "yes" if truth else "no"))
        want_yes = not want_yes
    return out
