"""Inputs for the tabular and sharded input tests: the same small images as a manifest, as
Parquet tables (bytes, HF Image structs, paths, URLs), as an HF dataset saved to disk and as
WebDataset shards, so each form's answers can be checked against the manifest's."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest

QUESTIONS = ["Is there a red shape?", "Is there a circle?"]


def make_images(folder: Path, n: int) -> list[Path]:
    """``n`` PNGs of varied sizes and contents in ``folder``."""
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        img = rng.integers(0, 256, (30 + 7 * (i % 5), 40 + 3 * i, 3), dtype=np.uint8)
        paths.append(folder / f"{i:03d}.png")
        cv2.imwrite(str(paths[-1]), img)
    return paths


def write_policy(folder: Path) -> Path:
    p = folder / "policy.yaml"
    p.write_text("questions:\n" + "".join(f"  - {q}\n" for q in QUESTIONS))
    return p


def write_manifest(folder: Path, images: list[Path], ids: list[str],
                   urls: list[str] | None = None) -> Path:
    """One line per image (its path, or ``urls[i]``), with id ``ids[i]``, no own questions."""
    m = folder / "m.jsonl"
    m.write_text("".join(json.dumps({"id": i, "image": u}) + "\n"
                         for i, u in zip(ids, urls or [str(p) for p in images])))
    return m


def write_parquet(path: Path, columns: dict, row_group_size: int = 3) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def write_shards(folder: Path, images: list[Path], per_shard: int,
                 meta: dict[int, dict] | None = None) -> list[Path]:
    """WebDataset shards ``{0000..}.tar`` of ``per_shard`` samples: ``KEY.png`` and, for the
    images ``meta`` names, ``KEY.json`` holding that object (plus a ``KEY.cls`` member that a
    reader must skip)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, len(images), per_shard):
        shards.append(folder / f"{s // per_shard:04d}.tar")
        with tarfile.open(shards[-1], "w") as tar:
            for i in range(s, min(s + per_shard, len(images))):
                key = f"sample{i:04d}"
                _add(tar, f"{key}.png", images[i].read_bytes())
                if meta and i in meta:
                    _add(tar, f"{key}.json", json.dumps(meta[i]).encode())
                _add(tar, f"{key}.cls", b"7")
    return shards


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def answers(path: Path) -> dict[tuple[str, str], tuple]:
    """(id, question) -> (answer, p_yes, error) of a results file."""
    out = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out[d["id"], d["question"]] = (d["answer"], d["p_yes"], d["error"])
    return out


def same(got: dict, want: dict) -> bool:
    """The same answers and errors per (id, question), P(yes) within 5e-6: a run over a
    subset batches its images differently, and a line's P(yes) is rounded to 6 decimals, so
    a last-digit step is batching noise, not a different answer."""
    return got.keys() == want.keys() and all(
        g[0] == w[0] and g[2] == w[2] and (g[1] == w[1] or abs(g[1] - w[1]) <= 5e-6)
        for g, w in ((got[k], want[k]) for k in want))
