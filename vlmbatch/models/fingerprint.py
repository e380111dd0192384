"""A model's fingerprint: what identifies the answers a model gives, so that two runs agree on
whether they asked the same model. It names the checkpoint folder, a SHA-256 of its weights
and configuration files (their names and bytes), and the numerics the answers depend on (the
dtype, the quantisation): ``default_model@3f9c0a1be2d47a55/float32/none``.

A path alone is not one (a checkpoint re-trained or re-quantised in place keeps its path);
the hash is of the files, read once per process for each (path, size, mtime) they have.
Used by ``labels/review`` (a Label Studio prediction's ``model_version``) and by reuse
(``jobs/reuse.py``: an answer is copied only from a job of the same fingerprint).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

# the files that decide what a checkpoint computes: its weights and its configuration
HASHED = ("*.safetensors", "*.bin", "*.pt", "config.json", "*quant*.json")
DIGEST_CHARS = 16  # 64 bits of the SHA-256: two different checkpoints never meet by chance
CHUNK = 1 << 20


def _files(model_dir: Path) -> list[Path]:
    found = {p for pattern in HASHED for p in model_dir.glob(pattern) if p.is_file()}
    return sorted(found)


@functools.cache
def _digest(files: tuple[tuple[str, int, int], ...], root: str) -> str:
    h = hashlib.sha256()
    for name, size, _ in files:
        h.update(f"{name}\0{size}\0".encode())
        with (Path(root) / name).open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


def weights_digest(model_dir: Path) -> str:
    """The hex digest of ``model_dir``'s weights and configuration files; ValueError naming
    the folder when it holds none."""
    model_dir = Path(model_dir).resolve()
    files = _files(model_dir)
    if not files:
        raise ValueError(f"{model_dir} holds no weights (*.safetensors, *.bin) to fingerprint")
    key = tuple((p.name, (s := p.stat()).st_size, s.st_mtime_ns) for p in files)
    return _digest(key, str(model_dir))


def fingerprint(model_dir: Path, dtype: str, quant: str) -> str:
    """``NAME@DIGEST/DTYPE/QUANT``: the checkpoint, its files' digest, the dtype it runs in
    and its run-time quantisation (``none``, ``int8-dynamic``, ``fp8``; a W4A16 checkpoint is
    told apart by its weights)."""
    return f"{Path(model_dir).name}@{weights_digest(model_dir)}/{dtype}/{quant}"
