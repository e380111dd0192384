"""Inputs of embeddings: JSONL manifests of ``{"id", "image"?, "text"?}``, image files, a
folder of images, and texts (arguments or standard input, one per line).

A manifest line holds an image (a path relative to the manifest, a ``file://`` or ``data:``
URL), a text, or both (embedded as one prompt: the image, then the text); ``id`` is
optional (default: the line number) and unique. Every line is checked as read, before any
work: a malformed one raises ``ManifestError`` naming the file and line. Images are read
later, per item, so a missing image is that item's error. A job stores items as JSON
(``embed_item_to_json``/``embed_item_from_json``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from vlmbatch.inputs.errors import check_unicode
from vlmbatch.inputs.manifest import IMAGE_SUFFIXES
from vlmbatch.pipeline.questions import ManifestError, brief, check_id, check_keys
from vlmbatch.pipeline.records import EmbedItem

EMBED_KEYS = {"id", "image", "text"}


def iter_embed_manifest(path: Path) -> Iterator[tuple[int, EmbedItem]]:
    """(line number, item) per line, validated as read, in bounded memory; a repeated id is
    the caller's check (``read_embed_manifest`` keeps a set, a job store a UNIQUE key)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} not found")
    base_dir, n = path.parent.absolute(), 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ManifestError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            yield lineno, _item(_json_object(line, where), where, lineno, n, base_dir)
            n += 1
    if not n:
        raise ManifestError(f"manifest {path} has no items")


def _json_object(line: str, where: str) -> dict:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(rec, dict):
        raise ManifestError(f"{where}: each line must be a JSON object")
    return rec


def _item(rec: dict, where: str, lineno: int, index: int, base_dir: Path) -> EmbedItem:
    check_keys(rec, EMBED_KEYS, where, "an embedding line (image, text or both)")
    image, text = rec.get("image"), rec.get("text")
    for name, v in (("image", image), ("text", text)):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ManifestError(f"{where}: {name!r} must be a non-empty string, got {brief(v)}")
    if image is None and text is None:
        raise ManifestError(f"{where}: give an 'image', a 'text' or both")
    item_id = check_id(rec.get("id", lineno), where, "id")
    check_unicode([s for s in (item_id, image, text) if s is not None], where)
    return EmbedItem(index, item_id, image, text, base_dir)


def read_embed_manifest(path: Path) -> list[EmbedItem]:
    """Every line of an embedding manifest; a repeated id names both lines."""
    items: list[EmbedItem] = []
    seen: dict[str, int] = {}
    for lineno, item in iter_embed_manifest(path):
        if (first := seen.setdefault(item.key, lineno)) != lineno:
            raise ManifestError(f"{path}:{lineno}: id {brief(item.key)} appears twice (first "
                                f"on line {first})")
        items.append(item)
    return items


def image_items(paths: Iterable[Path]) -> list[EmbedItem]:
    """Image files as items, ids their paths as given (read later: a missing one is that
    item's error)."""
    return [EmbedItem(k, str(p), str(p), None, Path.cwd()) for k, p in enumerate(paths)]


def folder_items(folder: Path) -> list[EmbedItem]:
    """Every image file under ``folder`` (sorted, recursive), ids their relative paths."""
    if not Path(folder).is_dir():
        raise ManifestError(f"image folder {folder} not found")
    folder = Path(folder).absolute()
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ManifestError(f"no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder}")
    rel = [str(p.relative_to(folder)) for p in files]
    return [EmbedItem(k, r, r, None, folder) for k, r in enumerate(rel)]


def text_items(texts: Iterable[str]) -> list[EmbedItem]:
    """Texts as items (no ids: lines carry their index); an empty one is refused."""
    items = []
    for k, t in enumerate(texts):
        if not t.strip():
            raise ManifestError(f"text {k} is empty")
        items.append(EmbedItem(k, None, None, t, Path.cwd()))
    if not items:
        raise ManifestError("no texts to embed (give them as arguments or on standard input, "
                            "one per line)")
    return items


def embed_item_to_json(item: EmbedItem) -> str:
    """An item as a job store keeps it (image paths and URLs only)."""
    if item.image is not None and not isinstance(item.image, str):
        raise ManifestError(f"item {item.key!r}: a job stores image paths or URLs, not "
                            f"{type(item.image).__name__}")
    return json.dumps({"index": item.index, "id": item.id, "image": item.image,
                       "text": item.text, "base_dir": str(item.base_dir)}, ensure_ascii=False)


def embed_item_from_json(text: str) -> EmbedItem:
    d = json.loads(text)
    return EmbedItem(d["index"], d["id"], d["image"], d["text"], Path(d["base_dir"]))
