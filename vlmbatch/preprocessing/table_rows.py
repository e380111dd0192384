"""Image cells of Parquet and Arrow files by identity (``sources.RowRef``: file, row,
column), for the fetch stage (``fetch.py``).

Reads go a block at a time and the last ``keep`` blocks stay, so a run over consecutive rows
reads each block once and memory stays bounded by ``keep`` blocks of the image column:

    .parquet   a row group's image column (``ParquetFile.read_row_group``: one column chunk)
    .arrow     the whole file's table, memory-mapped (an HF dataset's ``save_to_disk`` files
               are Arrow IPC streams: reading them maps pages, it copies nothing)

Thread-safe: the fetch stage's threads share one ``TableRows``; a block wanted by several
threads at once is read once (the others wait for it). pyarrow is the ``parquet`` extra.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from vlmbatch.preprocessing.sources import RowRef, SourceError


def require_pyarrow() -> Any:
    try:  # optional dependency: the parquet extra
        import pyarrow as pa
    except ModuleNotFoundError:
        raise SourceError("reading Parquet or Arrow files needs pyarrow: pip install "
                          "'vlmbatch[parquet]'") from None
    return pa


def read_arrow_table(path: str) -> Any:
    """An ``.arrow`` file (IPC stream, as ``datasets`` writes, or IPC file) memory-mapped."""
    pa = require_pyarrow()
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(path)).read_all()


class TableRows:
    """Cells by ``RowRef``, ``keep`` blocks cached (module docstring)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.blocks: OrderedDict[tuple, Future] = OrderedDict()  # (file, block, column)
        self.starts: dict[str, list[int]] = {}  # a Parquet file's row-group first rows

    def cell(self, ref: RowRef) -> Any:
        """The cell's value as Python (bytes, a ``{"bytes", "path"}`` dict, a string or
        None); SourceError if the file, the row or the column cannot be read."""
        try:
            block, first = self._locate(ref)
            values = self._block(ref, block)
            return values[ref.row - first].as_py()
        except SourceError:
            raise
        except (OSError, ValueError, KeyError, IndexError) as e:  # pyarrow's errors among them
            raise SourceError(f"cannot read row {ref.row} of {ref.file}: {e}") from None

    def _locate(self, ref: RowRef) -> tuple[int, int]:
        """(block index, its first row) of the row."""
        if not ref.file.endswith(".parquet"):
            return 0, 0
        starts = self.starts.get(ref.file)
        if starts is None:
            starts = self.starts[ref.file] = _row_group_starts(ref.file)
        block = bisect.bisect_right(starts, ref.row) - 1
        if not 0 <= ref.row < starts[-1] or block < 0:
            raise SourceError(f"{ref.file} has no row {ref.row} (it has {starts[-1]})",
                              "not_found")
        return block, starts[block]

    def _block(self, ref: RowRef, block: int) -> Any:
        key = (ref.file, block, ref.column)
        with self.lock:
            f = self.blocks.get(key)
            mine = f is None
            if f is None:
                f = self.blocks[key] = Future()
                while len(self.blocks) > self.keep:
                    self.blocks.popitem(last=False)
            self.blocks.move_to_end(key)
        if mine:
            try:
                f.set_result(_read_block(ref, block))
            except BaseException as e:  # noqa: BLE001  (every waiter gets it)
                with self.lock:
                    self.blocks.pop(key, None)
                f.set_exception(e)
        return f.result()


def _row_group_starts(path: str) -> list[int]:
    """Each row group's first row, then the file's row count."""
    require_pyarrow()
    import pyarrow.parquet as pq  # optional dependency: the parquet extra

    meta = pq.ParquetFile(path).metadata
    starts = [0]
    for i in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(i).num_rows)
    return starts


def _read_block(ref: RowRef, block: int) -> Any:
    """The column's values in the block (a pyarrow ChunkedArray)."""
    require_pyarrow()
    if ref.file.endswith(".parquet"):
        import pyarrow.parquet as pq  # optional dependency: the parquet extra

        table = pq.ParquetFile(ref.file).read_row_group(block, columns=[ref.column])
    else:
        table = read_arrow_table(ref.file).select([ref.column])
    return table.column(0)
