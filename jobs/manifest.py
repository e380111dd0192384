"""Job inputs: JSONL manifests, policy files (YAML/TOML) and folders of images.

Manifest line: ``{"id": ..., "image": <path | file:// URL | data: URL>, "questions": [...]}``
where a question is a string or ``{"id", "text", "threshold"?}``. Relative paths are resolved
against the manifest's folder. A policy names questions applied to every image:

    questions:
      - {id: red, text: "Is there a red shape?", threshold: 0.5}

Validation is complete before any work starts: a malformed line raises ``ManifestError``
naming the file and line number. Reading image bytes happens later, per item, so a missing
image is that item's error, not the job's.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


class ManifestError(ValueError):
    """A manifest or policy file is malformed; the message names file, line and problem."""


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    threshold: float = 0.5


@dataclass(frozen=True)
class ImageItem:
    id: str
    image: str  # path, file:// or data: URL, as written in the input
    questions: tuple[Question, ...]
    base_dir: Path  # relative paths resolve against this


def _question(raw: object, where: str, index: int, prefix: str = "q") -> Question:
    if isinstance(raw, str):
        if not raw.strip():
            raise ManifestError(f"{where}: question {index} is empty")
        return Question(id=f"{prefix}{index}", text=raw)
    if not isinstance(raw, dict) or not isinstance(raw.get("text"), str) or not raw["text"]:
        raise ManifestError(f"{where}: question {index} must be a string or an object with a "
                            f"non-empty 'text', got {raw!r}")
    thr = raw.get("threshold", 0.5)
    if not isinstance(thr, (int, float)) or not 0.0 <= thr <= 1.0:
        raise ManifestError(f"{where}: question {index} threshold must be a number in [0, 1], "
                            f"got {thr!r}")
    return Question(id=str(raw.get("id", f"{prefix}{index}")), text=raw["text"],
                    threshold=float(thr))


def _questions(raw: object, where: str, prefix: str = "q") -> tuple[Question, ...]:
    """Questions without an id get ``{prefix}{index}``: q0, q1... in a manifest line,
    p0, p1... in a policy, so the two never collide by default."""
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: 'questions' must be a list, got {type(raw).__name__}")
    qs = tuple(_question(q, where, i, prefix) for i, q in enumerate(raw))
    ids = [q.id for q in qs]
    if len(set(ids)) != len(ids):
        raise ManifestError(f"{where}: question ids repeat: {ids}")
    return qs


def read_policy(path: Path) -> tuple[Question, ...]:
    """Questions of a YAML (.yaml/.yml) or TOML (.toml) policy file."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"policy file {path} not found")
    import yaml

    text = path.read_text()
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ManifestError(f"{path}: policy must be .yaml, .yml or .toml")
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ManifestError(f"{path}: cannot parse policy: {e}") from e
    if not isinstance(data, dict) or "questions" not in data:
        raise ManifestError(f"{path}: a policy needs a top-level 'questions' list")
    qs = _questions(data["questions"], str(path), prefix="p")
    if not qs:
        raise ManifestError(f"{path}: the policy has no questions")
    return qs


def read_manifest(path: Path, policy: tuple[Question, ...] = ()) -> list[ImageItem]:
    """Parse and validate every line; policy questions follow each line's own questions."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} not found")
    items: list[ImageItem] = []
    seen: set[str] = set()
    with path.open("rb") as f:
        for lineno, raw_line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ManifestError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: not valid JSON ({e.msg})") from e
            if not isinstance(rec, dict):
                raise ManifestError(f"{where}: each line must be a JSON object")
            if not isinstance(rec.get("image"), str) or not rec["image"]:
                raise ManifestError(f"{where}: missing 'image' (a path, file:// or data: URL)")
            item_id = str(rec.get("id", lineno))
            if item_id in seen:
                raise ManifestError(f"{where}: id {item_id!r} appears twice")
            seen.add(item_id)
            own = _questions(rec.get("questions", []), where)
            clash = {o.id for o in own} & {q.id for q in policy}
            if clash:
                raise ManifestError(f"{where}: question id(s) {sorted(clash)} are used by both "
                                    "this line and the policy; rename one")
            qs = own + policy
            if not qs:
                raise ManifestError(f"{where}: no questions (give 'questions' or --policy)")
            items.append(ImageItem(item_id, rec["image"], qs, path.parent))
    if not items:
        raise ManifestError(f"manifest {path} has no items")
    return items


def items_from_folder(folder: Path, policy: tuple[Question, ...]) -> list[ImageItem]:
    """Every image file under ``folder`` (sorted, recursive), each asked the policy."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ManifestError(f"image folder {folder} not found")
    if not policy:
        raise ManifestError("a folder of images needs --policy to say which questions to ask")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ManifestError(f"no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder}")
    return [ImageItem(str(p.relative_to(folder)), str(p), policy, folder) for p in files]

