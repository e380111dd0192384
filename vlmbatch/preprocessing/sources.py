"""Where an item's image bytes come from, and reading the local ones.

An image source (``pipeline/records.py`` ``ImageSource``) that names bytes to read is one of

    a path, ``file://`` or ``data:`` URL     read here (``read_bytes``), in the worker
    an ``http(s)://``, ``s3://``, ``gs://``,  fetched by the fetch stage (``fetch.py``) ahead
      ``az://``/``abfs://`` URL              of the decoders, many at once
    ``RowRef`` (a table's row)               a Parquet or Arrow file's image cell, read by
    ``MemberRef`` (a tar shard's member)     the fetch stage from the file by that identity
    ``NotAnImage``                           what the Python API was given instead of an
                                             image (``None``, ``42``): its ``source`` error

so a job stores where each image is (a path, a URL, a file and a row, a shard and a member),
never the image. Failures raise ``SourceError`` (an item error, kind ``source``), whose
``reason`` says which: ``not_found``, ``access_denied``, ``status`` (another HTTP status),
``timeout``, ``too_large``, ``connection``, ``redirects``, ``unreadable``. Light: stdlib only.
"""

from __future__ import annotations

import base64
import binascii
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlparse

HTTP = ("http", "https")
OBJECT_STORES = ("s3", "gs", "gcs", "az", "abfs", "abfss")  # through fsspec (extras)


class SourceError(ValueError):
    """The image could not be read; the message names the source and the reason."""

    def __init__(self, message: str, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple:  # crosses process boundaries (decoder pipes, Ray)
        return (type(self), (str(self), self.reason))


@dataclass(frozen=True)
class RowRef:
    """The image in ``column`` of row ``row`` (0-based, over the whole file) of a Parquet
    (``.parquet``) or Arrow (``.arrow``: an HF dataset's ``save_to_disk``) file at ``file``
    (absolute). The cell holds encoded bytes, or HF ``datasets``' Image struct ``{"bytes",
    "path"}`` (a path relative to the file's folder when there are no bytes)."""
    file: str
    row: int
    column: str

    @property
    def source(self) -> str:
        return f"{self.file}:{self.row}"


@dataclass(frozen=True)
class MemberRef:
    """A member of an uncompressed tar shard (WebDataset): its data is bytes
    ``[offset, offset + size)`` of ``shard`` (an absolute path or a URL), so it is read
    without scanning the shard again."""
    shard: str
    name: str  # the member's name in the shard, e.g. "000123.jpg"
    offset: int
    size: int

    @property
    def source(self) -> str:
        return f"{self.shard}:{self.name}"


@dataclass(frozen=True)
class NotAnImage:
    """An item whose image is none of the kinds above (the Python API given ``None`` or
    ``42`` in a list of images): reading it fails with ``why``, that item's error."""
    why: str


def scheme(source: str) -> str:
    """The URL scheme of ``source``, lower case ("" for a path)."""
    head, sep, _ = source.partition("://")
    return head.lower() if sep and head.isascii() and head.replace("+", "").isalnum() else ""


def is_remote(source: object) -> bool:
    """Whether ``source`` is read by the fetch stage (``fetch.py``): an http(s) or object-store
    URL, a table row or a shard member."""
    if isinstance(source, (RowRef, MemberRef)):
        return True
    return isinstance(source, str) and scheme(source) in HTTP + OBJECT_STORES


def describe(source: object) -> str:
    """How messages name an image source that is not a string."""
    return source.source if isinstance(source, (RowRef, MemberRef)) else f"{source!r}"[:80]


def read_bytes(source: str, base_dir: Path) -> bytes:
    """The bytes of a path (relative to ``base_dir``), ``file://`` or ``data:`` URL."""
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep:
            raise SourceError("data: URL without a ',' before its payload")
        try:
            if header.endswith(";base64"):
                return base64.b64decode(payload, validate=True)
            return unquote_to_bytes(payload)
        except (binascii.Error, ValueError) as e:
            raise SourceError(f"data: URL payload is not valid base64 ({e})") from e
    if source.startswith("file://"):
        path = Path(unquote(urlparse(source).path))
    elif "://" in source:
        s = source.split("://", 1)[0]
        if is_remote(source):  # a caller that skipped the fetch stage: a bug, said plainly
            raise SourceError(f"{s}:// images are read by the fetch stage "
                              "(preprocessing/fetch.py), not here")
        raise SourceError(f"unsupported URL scheme {s!r}: vlmbatch reads local paths, file://, "
                          "data:, http(s)://, s3://, gs:// and az:// URLs")
    else:
        path = Path(source)
        if not path.is_absolute():
            path = base_dir / path
    try:
        mode = path.stat().st_mode
        if stat.S_ISREG(mode):  # not a FIFO or device, whose read could block forever
            return path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"file not found: {path}", "not_found") from None
    except PermissionError:
        raise SourceError(f"permission denied: {path}", "access_denied") from None
    except IsADirectoryError:
        raise SourceError(f"is a directory, not an image: {path}") from None
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # e.g. a NUL byte in the path
        raise SourceError(f"bad path {str(path)!r}: {e}") from None
    if stat.S_ISDIR(mode):
        raise SourceError(f"is a directory, not an image: {path}")
    raise SourceError(f"not a regular file (a pipe, socket or device?): {path}")
