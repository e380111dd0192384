"""Read an item's image bytes from a path, a ``file://`` URL or a ``data:`` URL.

No network is assumed anywhere vlmbatch runs, so ``http(s)://`` and other schemes are refused
with a message saying what to do instead. Failures raise ``SourceError`` (an item error).
"""

from __future__ import annotations

import base64
import binascii
import stat
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlparse


class SourceError(ValueError):
    """The image could not be read; the message names the source and the reason."""


def read_bytes(source: str, base_dir: Path) -> bytes:
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
        scheme = source.split("://", 1)[0]
        raise SourceError(f"unsupported URL scheme {scheme!r}: vlmbatch reads local paths, "
                          "file:// and data: URLs; download the image first")
    else:
        path = Path(source)
        if not path.is_absolute():
            path = base_dir / path
    try:
        mode = path.stat().st_mode
        if stat.S_ISREG(mode):  # not a FIFO or device, whose read could block forever
            return path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"file not found: {path}") from None
    except IsADirectoryError:
        raise SourceError(f"is a directory, not an image: {path}") from None
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # e.g. a NUL byte in the path
        raise SourceError(f"bad path {str(path)!r}: {e}") from None
    if stat.S_ISDIR(mode):
        raise SourceError(f"is a directory, not an image: {path}")
    raise SourceError(f"not a regular file (a pipe, socket or device?): {path}")
