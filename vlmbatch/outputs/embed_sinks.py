"""Where embeddings go: JSONL lines (``Embedding.line``), Parquet (``embedding`` a
fixed-size-list column of float32; a multi-vector a list of them), or ``.npy`` (one float32
``[N, D]`` array, a failed item's row NaN). Written a group at a time by ``vlmbatch embed``
and ``vlmbatch results`` of an embedding job; each derives from ``pipeline.records
.Embedding``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

import numpy as np

from vlmbatch.engine.config import ConfigError
from vlmbatch.pipeline.records import Embedding

EMBED_FORMATS = ("jsonl", "parquet", "npy")


def embed_format_of(path: Path | None) -> str:
    """The format an output path asks for by its suffix: parquet, npy, else jsonl."""
    suffix = path.suffix.lower() if path is not None else ""
    return {".parquet": "parquet", ".npy": "npy"}.get(suffix, "jsonl")


class EmbeddingSink(ABC):
    @abstractmethod
    def write(self, embeddings: list[Embedding]) -> None: ...

    def close(self) -> None:
        """Finish the file (Parquet's footer, the array's rows)."""


class JsonlSink(EmbeddingSink):
    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def write(self, embeddings: list[Embedding]) -> None:
        self.out.write("".join(json.dumps(e.line(), ensure_ascii=False) + "\n"
                               for e in embeddings))
        self.out.flush()


class ParquetSink(EmbeddingSink):
    """Columns ``index, id, tokens, embedding, error``, in row groups of ``rows_per_group``;
    the schema is fixed by the first vector's size (every item of a run has the same D)."""

    def __init__(self, path: Path, rows_per_group: int = 65536) -> None:
        try:  # optional dependency: the parquet extra
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ModuleNotFoundError as e:
            raise ImportError("Parquet output needs pyarrow: pip install 'vlmbatch[parquet]'"
                              ) from e
        self.pa, self.pq, self.path, self.rows_per_group = pa, pq, path, rows_per_group
        self.rows: list[Embedding] = []
        self.writer: Any = None
        self.schema: Any = None

    def write(self, embeddings: list[Embedding]) -> None:
        self.rows += embeddings
        if len(self.rows) >= self.rows_per_group:
            self._flush()

    def _schema(self) -> Any:
        pa = self.pa
        v = next((e.vector for e in self.rows if e.vector is not None), None)
        dim = 0 if v is None else v.shape[-1]
        vec = pa.list_(pa.float32(), dim)  # fixed size
        multi = v is not None and v.ndim == 2
        return pa.schema([("index", pa.int64()), ("id", pa.string()), ("tokens", pa.int64()),
                          ("embedding", pa.list_(vec) if multi else vec),
                          ("error", pa.string())])

    def _flush(self) -> None:
        if self.writer is None:
            self.schema = self._schema()
            self.writer = self.pq.ParquetWriter(str(self.path), self.schema)
        cols = {"index": [e.index for e in self.rows], "id": [e.id for e in self.rows],
                "tokens": [e.tokens for e in self.rows],
                "embedding": [None if e.vector is None else e.vector.tolist()
                              for e in self.rows],
                "error": [e.error for e in self.rows]}
        self.writer.write_table(self.pa.Table.from_pydict(cols, self.schema))
        self.rows = []

    def close(self) -> None:
        if self.rows or self.writer is None:
            self._flush()
        self.writer.close()


class NpySink(EmbeddingSink):
    """A float32 ``[n, D]`` array, row ``i`` the i-th embedding written; NaN for a failed item.
    Multi-vector embeddings have no common shape: refused (JSONL or Parquet hold them)."""

    def __init__(self, path: Path, n: int) -> None:
        self.path, self.n, self.row = path, n, 0
        self.pending: list[Embedding] = []  # until the first vector gives D
        self.array: np.memmap | None = None

    def write(self, embeddings: list[Embedding]) -> None:
        self.pending += embeddings
        if self.array is None:
            v = next((e.vector for e in self.pending if e.vector is not None), None)
            if v is None:
                return
            if v.ndim != 1:
                raise ConfigError("a .npy file holds one vector per input: multi-vector "
                                  "embeddings go to .jsonl or .parquet")
            self.array = np.lib.format.open_memmap(self.path, "w+", np.float32,
                                                   (self.n, v.shape[0]))
        for e in self.pending:
            self.array[self.row] = np.nan if e.vector is None else e.vector
            self.row += 1
        self.pending = []

    def close(self) -> None:
        if self.array is None:  # no vector at all: an empty [n, 0] array
            with open(self.path, "wb") as f:  # (np.save on a name would add ".npy")
                np.save(f, np.full((self.n, 0), np.nan, np.float32))
            return
        self.array.flush()
        del self.array
