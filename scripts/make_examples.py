"""Write examples/: a dozen shape scenes, a manifest asking about them, and a policy; and
examples/labelled/: 48 more scenes, a manifest whose questions carry their true answers
(``expected``, from the scene's shapes) and the same labels as a labels file, for ``vlmbatch
eval MANIFEST``, ``calibrate`` and ``report``.

    python scripts/make_examples.py               # --video-only: clip.mkv, video.jsonl

Deterministic (fixed seeds); the committed files are this script's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlmbatch.cli.bench.shapes import COLORS, Scene, make_questions, make_scene  # noqa: E402

POLICY = """\
# Asked of every image in the manifest (vlmbatch run ... --policy examples/policy.yaml).
questions:
  - id: red
    text: Is there a red shape?
  - id: circle
    text: Does the image contain a circle?
  - id: several
    text: Is there more than one shape?
    threshold: 0.5
"""


def main(video_only: bool = False) -> None:
    """Everything; or, ``video_only``, the clip and video.jsonl from the committed scenes
    (PNGs not rewritten: OpenCV 5.1.0 draws some anti-aliased edges differently from the
    OpenCV that made the committed ones, which would change 9 of the 12). The clip's frames
    are the same every run; its bytes are not (Matroska writes a random segment id)."""
    out = ROOT / "examples"
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2026)
    lines, scenes = [], []
    for i in range(12):
        scene = make_scene(rng)
        scenes.append(scene)
        name = f"images/scene_{i:02d}.png"
        if not video_only:
            cv2.imwrite(str(out / name), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        texts = dict.fromkeys(q[0].upper() + q[1:] for q, _ in make_questions(scene, rng, 3))
        qs = [{"id": f"q{k}", "text": t} for k, t in enumerate(list(texts)[:2])]
        lines.append({"id": f"scene_{i:02d}", "image": name, "questions": qs})
    if not video_only:
        (out / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (out / "policy.yaml").write_text(POLICY)
        labelled(out / "labelled")
    video(out, scenes)


def video(out: Path, scenes: list[Scene]) -> None:
    """examples/clip.mkv (the 12 scenes, 2 s each at 1 fps: lossless FFV1) and
    examples/video.jsonl: two questions about the clip (a colour some scenes have, and the
    first colour none has: "yes" and "no" whichever frames are sampled) and one about two
    scenes in one prompt."""
    import av  # the clip's writer; PyAV ships FFmpeg

    frames = [cv2.cvtColor(cv2.imread(str(out / f"images/scene_{i:02d}.png")),
                           cv2.COLOR_BGR2RGB) for i in range(12)]
    with av.open(str(out / "clip.mkv"), "w", format="matroska") as c:
        s = c.add_stream("ffv1", rate=1)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "bgr0"
        for i, img in enumerate(f for f in frames for _ in range(2)):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            c.mux(s.encode(frame))
        c.mux(s.encode())
    absent = next(c for c in COLORS if all(s.color != c for sc in scenes for s in sc.shapes))
    lines = [{"id": "clip", "video": "clip.mkv", "num_frames": 4,
              "questions": ["Is there a red shape?", f"Is there a {absent} shape?"]},
             {"id": "pair", "images": ["images/scene_00.png", "images/scene_01.png"],
              "questions": ["Is there a red shape?"]}]
    (out / "video.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


# the labelled example's questions: id -> (text, the truth of a scene)
LABELLED = {
    "red": ("Is there a red shape?", lambda sc: any(s.color == "red" for s in sc.shapes)),
    "circle": ("Does the image contain a circle?",
               lambda sc: any(s.kind == "circle" for s in sc.shapes)),
    "triangle": ("Is there a triangle?",
                 lambda sc: any(s.kind == "triangle" for s in sc.shapes)),
    "three": ("Are there three shapes?", lambda sc: len(sc.shapes) == 3),
}


def labelled(out: Path, n: int = 48) -> None:
    """``n`` scenes, each asked LABELLED's questions with ``expected`` its true answer."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2027)
    lines, labels = [], []
    for i in range(n):
        scene: Scene = make_scene(rng)
        name = f"images/l{i:02d}.png"
        cv2.imwrite(str(out / name), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        qs = [{"id": qid, "text": text, "expected": "yes" if truth(scene) else "no"}
              for qid, (text, truth) in LABELLED.items()]
        lines.append({"id": f"l{i:02d}", "image": name, "questions": qs})
        labels += [{"id": f"l{i:02d}", "question_id": q["id"], "expected": q["expected"]}
                   for q in qs]
    (out / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "labels.jsonl").write_text("".join(json.dumps(x) + "\n" for x in labels))


if __name__ == "__main__":
    main(video_only="--video-only" in sys.argv[1:])
