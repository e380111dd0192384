"""Tabular and sharded inputs: Parquet files (one, a folder or a glob), an HF dataset saved
with ``save_to_disk`` (its Arrow files), and WebDataset tar shards (a brace pattern of paths
or URLs), each listed as ``ImageItem``s whose image is a reference, never the bytes:

    Parquet / Arrow   an image column of encoded bytes or of HF ``datasets``' Image structs
                      ``{"bytes", "path"}`` -> ``RowRef(file, row, column)``; a column of
                      paths or URLs -> that string (a path relative to the file's folder)
    WebDataset        ``KEY.jpg|jpeg|png|webp`` (+ optional ``KEY.json``: ``{"id"?,
                      "questions"?}``, no other key) -> ``MemberRef(shard, member,
                      offset, size)``

An item's identity is (file, row) or (shard, key): its id is the ``--id-column``'s value
(the json's ``id``), else ``FILE:ROW`` / ``SHARD:KEY`` (file names relative to the input's
folder); a job stores the references, and the fetch stage (``preprocessing/fetch.py``) reads
each image by it when the item is prepared. Listing reads no image bytes: Parquet in row-group
batches of the id and questions columns only, Arrow files memory-mapped, tar shards streamed
header by header (a local shard's data is skipped over, a URL's streamed past: nothing is
unpacked to disk). Validation is complete before any work: a missing column, a bad question
or a sample without an image is a ``ManifestError`` naming where. pyarrow (the ``parquet``
extra) is needed for tables, not for shards; ``datasets`` is needed by neither.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vlmbatch.inputs.errors import check_unicode
from vlmbatch.inputs.manifest import with_policy
from vlmbatch.pipeline.questions import (
    QUESTION_KEYS,
    ManifestError,
    Question,
    brief,
    check_id,
    check_keys,
    parse_question,
)
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.preprocessing.fetch import Fetcher
from vlmbatch.preprocessing.limits import FetchOptions
from vlmbatch.preprocessing.sources import MemberRef, RowRef, SourceError, is_remote
from vlmbatch.preprocessing.table_rows import read_arrow_table

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SAMPLE_KEYS = frozenset({"id", "questions"})  # a WebDataset sample's KEY.json
HF_FILES = ("state.json", "dataset_info.json")
COMPRESSED = (".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz")  # refused: no offsets
_BRACE = re.compile(r"\{[^{}]*(,|\.\.)[^{}]*\}")  # a brace pattern's innermost group


def input_kind(text: str) -> str | None:
    """"table" (Parquet/Arrow: a file, a folder of them, a glob, an HF dataset folder),
    "shards" (tar shards: ``.tar`` paths or URLs, brace patterns), else None (a manifest)."""
    if _BRACE.search(text) or text.endswith((".tar", *COMPRESSED)):
        return "shards"
    if text.endswith((".parquet", ".arrow")) or (not is_remote(text) and glob.has_magic(text)):
        return "table"
    p = Path(text)
    if p.is_dir() and (any((p / f).is_file() for f in HF_FILES) or any(p.glob("*.parquet"))
                       or (p / "dataset_dict.json").is_file()):
        return "table"
    return None


def iter_dataset(text: str, image_column: str, id_column: str | None,
                 questions_column: str | None, policy: tuple[Question, ...],
                 fetch: FetchOptions = FetchOptions()) -> Iterator[tuple[str, ImageItem]]:
    """(where, item) of a table or shard input (``input_kind``); URL shards are streamed
    through a fetch stage of ``fetch``'s settings."""
    if input_kind(text) == "shards":
        if id_column or questions_column or image_column != "image":
            raise ManifestError("--image-column, --id-column and --questions-column are a "
                                "table's: a WebDataset sample names its image by extension and "
                                "its id and questions in KEY.json")
        with Fetcher(fetch) as fetcher:
            yield from iter_shards(text, policy, functools.partial(_listed, fetcher))
        return
    yield from iter_table(text, image_column, id_column, questions_column, policy)


@contextlib.contextmanager
def _listed(fetcher: Fetcher, url: str) -> Iterator[IO[bytes]]:
    """A URL shard's stream, its failures the input's (a shard that cannot be listed)."""
    try:
        with fetcher.open_stream(url) as f:
            yield f
    except SourceError as e:
        raise ManifestError(f"shard {url}: {e}") from None


# --- tables ---------------------------------------------------------------------------------

def table_files(text: str) -> tuple[list[Path], Path]:
    """The Parquet/Arrow files of a table input, in order, and the folder their names in ids
    are relative to."""
    p = Path(text)
    if glob.has_magic(text):
        files = sorted(Path(f).absolute() for f in glob.glob(text, recursive=True)
                       if f.endswith((".parquet", ".arrow")))
        root = Path(os.path.commonpath([f.parent for f in files])) if files else p.parent
    elif p.is_dir():
        files, root = _folder_files(p.absolute()), p.absolute()
    elif p.is_file():
        files, root = [p.absolute()], p.absolute().parent
    else:
        raise ManifestError(f"{text}: no such file or folder")
    if not files:
        raise ManifestError(f"{text}: no .parquet or .arrow files")
    return files, root


def _folder_files(folder: Path) -> list[Path]:
    """An HF dataset's Arrow files (``state.json`` order), else every Parquet file below."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ManifestError(f"{folder} holds a DatasetDict (splits {splits}): give one split's "
                            f"folder, e.g. {folder / (splits[0] if splits else 'train')}")
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"{state}: not an HF dataset's state ({e})") from None
        return [folder / n for n in names]
    return sorted(folder.rglob("*.parquet"))


def iter_table(text: str, image_column: str, id_column: str | None,
               questions_column: str | None, policy: tuple[Question, ...]
               ) -> Iterator[tuple[str, ImageItem]]:
    """(where, item) for each row of the table input ``text``, in file then row order."""
    files, root = table_files(text)
    for file in files:
        name = file.relative_to(root).as_posix()
        for row, (ident, own, cell) in enumerate(_rows(file, image_column, id_column,
                                                       questions_column)):
            where = f"{file}:row {row}"
            item_id = check_id(ident, where, "id") if id_column else f"{name}:{row}"
            qs = with_policy(own_questions(own, where), policy, where,
                             "give --policy or --questions-column")
            image = RowRef(str(file), row, image_column) if cell is None else cell
            if isinstance(image, str) and not image:
                raise ManifestError(f"{where}: empty {image_column!r}")
            check_unicode([item_id, *(s for q in qs for s in (q.id, q.text))], where)
            yield where, ImageItem(item_id, image, qs, file.parent)


def _rows(file: Path, image_column: str, id_column: str | None,
          questions_column: str | None) -> Iterator[tuple[Any, Any, str | None]]:
    """(id, questions, image string or None) per row: the image column itself is read only
    when it holds strings (paths, URLs); bytes stay in the file."""
    t = _Table(file)
    strings = _check_columns(file, t.schema, image_column, id_column, questions_column)
    cols = [c for c in (id_column, questions_column) if c] + ([image_column] if strings else [])
    if not cols:  # only the row count is needed
        yield from ((None, None, None) for _ in range(t.num_rows))
        return
    for batch in t.batches(cols):
        d = batch.to_pydict()
        for i in range(batch.num_rows):
            yield (d[id_column][i] if id_column else None,
                   d[questions_column][i] if questions_column else None,
                   d[image_column][i] if strings else None)


class _Table:
    """A Parquet file (read in row-group batches) or an Arrow file (memory-mapped)."""

    def __init__(self, file: Path) -> None:
        try:  # optional dependency: the parquet extra
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ModuleNotFoundError:
            raise ManifestError("Parquet and Arrow inputs need pyarrow: pip install "
                                "'vlmbatch[parquet]'") from None
        self.file = file
        try:
            if file.suffix == ".parquet":
                self.pf: Any = pq.ParquetFile(file)
                self.schema, self.num_rows = self.pf.schema_arrow, self.pf.metadata.num_rows
            else:
                self.table = read_arrow_table(str(file))
                self.schema, self.num_rows = self.table.schema, self.table.num_rows
        except (OSError, pa.ArrowException) as e:
            raise ManifestError(f"{file}: not a readable Parquet/Arrow file ({e})") from None

    def batches(self, cols: list[str]) -> Iterator[Any]:
        if self.file.suffix == ".parquet":
            return self.pf.iter_batches(batch_size=4096, columns=cols)
        return iter(self.table.select(cols).to_batches(4096))


def _check_columns(file: Path, schema: Any, image: str, id_column: str | None,
                   questions: str | None) -> bool:
    """ManifestError for a column the file lacks or an image column of another type; True
    when the image column holds strings (paths or URLs)."""
    import pyarrow as pa  # optional dependency: the parquet extra

    for c in (image, id_column, questions):
        if c and c not in schema.names:
            raise ManifestError(f"{file}: no column {c!r} (it has {brief(schema.names)}); "
                                "name the image column with --image-column")
    t = schema.field(image).type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
            pa.types.is_struct(t) and "bytes" in [t.field(i).name for i in range(t.num_fields)]):
        return False
    raise ManifestError(f"{file}: column {image!r} is {t}: an image column holds encoded bytes, "
                        "{bytes, path} structs (HF datasets' Image) or paths/URLs")


def own_questions(raw: object, where: str) -> tuple[Question, ...]:
    """A row's questions: a string, a list of strings/question objects, or a JSON text of
    either; None for none."""
    if raw is None:
        return ()
    if isinstance(raw, str) and raw.lstrip().startswith(("[", "{")):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ManifestError(f"{where}: questions are not valid JSON ({e})") from None
    items = [raw] if isinstance(raw, (str, dict)) else raw
    if not isinstance(items, list):
        raise ManifestError(f"{where}: questions must be a string or a list, got {brief(raw)}")
    qs = tuple(parse_question(q, where, i) for i, q in enumerate(items))
    if len({q.id for q in qs}) != len(qs):
        raise ManifestError(f"{where}: question ids repeat: {brief([q.id for q in qs])}")
    return qs


# --- WebDataset shards ----------------------------------------------------------------------

def expand_braces(text: str) -> list[str]:
    """Bash-style brace expansion: ``{a,b}`` alternatives and ``{000..099}`` ranges (zero
    padding as bash pads), nested or several, outermost and leftmost first; a ``{x}`` with
    neither stays as written (tested against bash)."""
    start = text.find("{")
    while start != -1:
        group = _group(text, start)
        if group is None:
            return [text]  # unbalanced: literal
        end, commas = group
        body = text[start + 1:end]
        options = ([text[a + 1:b] for a, b in zip([start, *commas], [*commas, end])] if commas
                   else _range(body))
        if options is not None:
            head, tail = text[:start], text[end + 1:]
            return [x for opt in options for x in expand_braces(head + opt + tail)]
        start = text.find("{", start + 1)
    return [text]


def _group(text: str, start: int) -> tuple[int, list[int]] | None:
    """The index of the ``}`` closing the ``{`` at ``start``, and of its top-level commas."""
    depth, commas = 0, list[int]()
    for j in range(start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j, commas
        elif c == "," and depth == 1:
            commas.append(j)
    return None


def _range(body: str) -> list[str] | None:
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if m is None:
        return None
    a, b = m.group(1), m.group(2)
    pad = any(len(x.lstrip("-")) > 1 and x.lstrip("-").startswith("0") for x in (a, b))
    width = max(len(a), len(b)) if pad else 0
    step = 1 if int(b) >= int(a) else -1
    return [str(i).zfill(width) for i in range(int(a), int(b) + step, step)]


def iter_shards(pattern: str, policy: tuple[Question, ...],
                opener: Any = None) -> Iterator[tuple[str, ImageItem]]:
    """(where, item) per sample of each shard of ``pattern``, in shard then member order.
    ``opener(url)``: a context manager giving a URL shard's stream (``fetch.open_stream``)."""
    shards = [s if is_remote(s) else str(Path(s).absolute()) for s in expand_braces(pattern)]
    for shard in shards:
        if shard.endswith(COMPRESSED):
            raise ManifestError(f"{shard}: a compressed shard; its members cannot be read by "
                                "offset: give uncompressed .tar shards")
        name = shard.rsplit("/", 1)[-1]
        for key, members in _samples(shard, opener):
            where = f"{shard}:{key}"
            yield where, _sample_item(shard, name, key, members, policy, where)


def _samples(shard: str, opener: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, {extension: TarInfo, or the json member's parsed text}) per sample, members of
    one key being consecutive (WebDataset's layout)."""
    if is_remote(shard):
        with opener(shard) as stream:
            yield from _tar_samples(shard, stream, "r|")
        return
    if not Path(shard).is_file():
        raise ManifestError(f"shard {shard} not found")
    with open(shard, "rb") as f:
        yield from _tar_samples(shard, f, "r:")


def _tar_samples(shard: str, f: IO[bytes], mode: str) -> Iterator[tuple[str, dict[str, Any]]]:
    key, members = None, {}
    try:
        with tarfile.open(fileobj=f, mode=mode) as tar:  # type: ignore[call-overload]
            for m in tar:
                if not m.isfile():
                    continue
                k, _, ext = _split(m.name)
                if k != key and key is not None:
                    yield key, members
                    members = {}
                key = k
                members[ext.lower()] = (_json(tar, m, shard) if ext.lower() == "json" else m)
    except tarfile.TarError as e:
        raise ManifestError(f"{shard}: not a readable tar shard ({e})") from None
    if key is not None:
        yield key, members


def _split(name: str) -> tuple[str, str, str]:
    """WebDataset's split of a member name: the key up to the first dot of its base name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), dot, ext


def _json(tar: tarfile.TarFile, m: tarfile.TarInfo, shard: str) -> Any:
    f = tar.extractfile(m)
    assert f is not None  # a regular file
    try:
        return json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{shard}:{m.name}: not valid JSON ({e})") from None


def _sample_item(shard: str, name: str, key: str, members: dict[str, Any],
                 policy: tuple[Question, ...], where: str) -> ImageItem:
    ext = next((e for e in IMAGE_EXTS if e in members), None)
    if ext is None:
        raise ManifestError(f"{where}: no image member ({', '.join('.' + e for e in IMAGE_EXTS)}"
                            f"; it has {brief(sorted(members))})")
    meta = members.get("json") or {}
    if not isinstance(meta, dict):
        raise ManifestError(f"{where}.json: must be an object with 'id' and/or 'questions'")
    check_keys(meta, SAMPLE_KEYS, f"{where}.json", "a sample's json",
               inner=("a question object", QUESTION_KEYS))
    item_id = check_id(meta["id"], where, "id") if "id" in meta else f"{name}:{key}"
    qs = with_policy(own_questions(meta.get("questions"), where), policy, where,
                     f"give --policy or 'questions' in {key}.json")
    m = members[ext]
    check_unicode([item_id, *(s for q in qs for s in (q.id, q.text))], where)
    return ImageItem(item_id, MemberRef(shard, m.name, m.offset_data, m.size), qs,
                     Path(shard).parent if not is_remote(shard) else Path("/"))
