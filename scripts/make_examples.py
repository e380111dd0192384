"""Write examples/: a dozen shape scenes, a manifest asking about them, and a policy.

    python scripts/make_examples.py

Deterministic (fixed seed); the committed files are this script's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.shapes import make_questions, make_scene  # noqa: E402

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


def main() -> None:
    out = ROOT / "examples"
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2026)
    lines = []
    for i in range(12):
        scene = make_scene(rng)
        name = f"images/scene_{i:02d}.png"
        cv2.imwrite(str(out / name), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        texts = dict.fromkeys(q[0].upper() + q[1:] for q, _ in make_questions(scene, rng, 3))
        qs = [{"id": f"q{k}", "text": t} for k, t in enumerate(list(texts)[:2])]
        lines.append({"id": f"scene_{i:02d}", "image": name, "questions": qs})
    (out / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "policy.yaml").write_text(POLICY)


if __name__ == "__main__":
    main()
