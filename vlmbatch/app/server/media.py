"""A request's images: which URLs may be read (the media policy), and a chat image prepared.

The policy (``check_image_url``), checked before anything is read:

- ``data:`` URLs: always (the bytes travel in the request).
- ``file://`` URLs: only with ``--allowed-local-media-path DIR``, and only for a file whose
  real path (``..`` and symlinks resolved) is inside DIR; a host other than ``localhost``
  is refused, as is anything that is not a regular file.
- ``http(s)://``: only with ``--allow-remote-media``, and then fetched by the fetch stage
  under the SSRF guard (``preprocessing/guard.py``: every connection's host resolved and
  checked, redirects included, connected to the checked address). A chat request's host is
  also checked by its spelling here, before anything is queued (an internal IP literal, a
  numeric spelling); a batch line's is checked when it is fetched (that line's error).
- every other scheme, and bare paths: refused (a bare path would be read relative to the
  server's folder).

The check parses a URL exactly as ``preprocessing.sources.read_bytes`` will read it
(``unquote(urlparse(url).path)``), so what is checked is what is read. A ``MediaRefused``
carries the reason; the server answers it with a 400.

A chat image (``ImageCache``) is then read, decoded and tiled in one of the server's decoder
processes while the request's worker thread waits (each image under ``--decode-timeout``:
one that hangs or crashes its decoder is that request's 400, and the server goes on; a bad
image likewise), and kept in a small LRU by the xxh3 hash of its ``data:`` URL (at most
``budget`` bytes of tiles), so clients that send the same image again (the usual case:
several questions about one image) skip its decode. ``file://`` images are read each time
(the file may change). The engine's prefix cache is keyed by pixels, not by URL: two
different URLs of the same pixels still share their cached prefix; this cache only saves
the decode.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import unquote, urlparse

import xxhash

from vlmbatch.app.server.errors import bad_request
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import Preparer, prepare_now
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.pipeline.task import ImageRef
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.guard import check_url_host
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecodeTimeout
from vlmbatch.preprocessing.limits import MediaGuard
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage
from vlmbatch.preprocessing.sources import SourceError


class MediaRefused(ValueError):
    """The URL may not be read by this server; the message says why and what to do."""


def check_image_url(url: str, allowed: Path | None, remote: MediaGuard | None = None,
                    hosts: bool = True) -> str:
    """``url`` if the server may read it, else ``MediaRefused``. A ``file://`` URL comes back
    as the ``file://`` URL of its resolved path (what was checked is what is read). An
    http(s) URL passes only with ``remote`` (``--allow-remote-media``), its host's spelling
    checked by the guard when ``hosts``."""
    if url.startswith("data:"):
        return url
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("http", "https") and remote is not None:
        if hosts:
            try:
                check_url_host(url, remote)
            except SourceError as e:
                raise MediaRefused(str(e)) from None
        return url
    if scheme in ("http", "https"):
        raise MediaRefused("http(s) image URLs are not fetched by this server (started "
                           "without --allow-remote-media); send the image inline as a data: URL "
                           "(data:image/png;base64,...)")
    if scheme != "file":
        raise MediaRefused("image_url.url must be a data: URL (or a file:// URL under the "
                           "server's --allowed-local-media-path)")
    if allowed is None:
        raise MediaRefused("file:// image URLs are refused: the server was not started with "
                           "--allowed-local-media-path; send a data: URL instead")
    return local_url(url, allowed)


def local_url(url: str, allowed: Path) -> str:
    """The resolved ``file://`` URL of ``url`` if it names a regular file inside
    ``allowed``."""
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaRefused(f"file:// URL with host {parsed.netloc!r}: only local files "
                           "(file:///path) are read")
    raw = unquote(parsed.path)
    if "\x00" in raw:
        raise MediaRefused("file:// URL with a NUL byte in its path")
    root = Path(allowed).resolve()
    outside = MediaRefused("file:// URL outside --allowed-local-media-path (after resolving "
                           "'..' and symlinks): refused")
    given = Path(os.path.normpath(os.path.abspath(allowed)))  # as typed: may hold a symlink
    lexical = Path(os.path.normpath(raw))
    if not raw.startswith("/") or not (lexical.is_relative_to(root)
                                       or lexical.is_relative_to(given)):
        raise outside  # decided before touching the file system: no probing outside the root
    try:
        path = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise MediaRefused("file:// URL names no readable file under "
                           "--allowed-local-media-path") from None
    if not path.is_relative_to(root):
        raise outside
    if not path.is_file():
        raise MediaRefused("file:// URL does not name a regular file")
    return path.as_uri()


PARAM = "messages"


class ImageCache:
    def __init__(self, plan: ImagePlan, opts: PrepareOptions, allowed: Path | None,
                 budget: int, workers: Preparer | None, remote: MediaGuard | None = None
                 ) -> None:
        """``workers``: the server's decoder processes for ``plan`` (None: decode on the
        request's thread, ``--decode-timeout 0``); ``remote``: http(s) URLs allowed, under
        this guard (``opts.fetch.guard`` checks their connections)."""
        self.plan, self.opts, self.allowed, self.budget = plan, opts, allowed, budget
        self.remote = remote
        self.workers = workers
        self._lru: OrderedDict[bytes, PreparedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def cached(self, item: ImageItem) -> PreparedImage | None:
        """``item``'s prepared image if this ``data:`` URL was prepared before (cheap: the
        event loop asks this first, and hands a miss to ``prepare`` on a worker thread)."""
        if not isinstance(item.image, str) or not item.image.startswith("data:"):
            return None
        return self._hit(_key(item.image))

    def _hit(self, key: bytes) -> PreparedImage | None:
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
            return hit

    def prepare(self, item: ImageItem) -> PreparedImage:
        """``item``'s image prepared for the engine, or a 400 saying what is wrong with it."""
        assert isinstance(item.image, str)
        try:
            url = check_image_url(item.image, self.allowed, self.remote)
        except MediaRefused as e:
            raise bad_request(str(e), PARAM, "invalid_image_url") from None
        key = _key(url)
        if (hit := self._hit(key)) is not None:
            return hit
        image = self._decode(ImageRef(url, item.base_dir, item.source))
        if url.startswith("data:") and _size(image) <= self.budget:
            with self._lock:
                if key not in self._lru:
                    self._lru[key] = image
                    self._bytes += _size(image)
                while self._bytes > self.budget:
                    self._bytes -= _size(self._lru.popitem(last=False)[1])
        return image

    def _decode(self, ref: ImageRef) -> PreparedImage:
        try:
            return prepare_now(ref, self.plan, self.opts, self.workers)
        except SourceError as e:
            raise bad_request(f"the image could not be read: {e}", PARAM,
                              "invalid_image_url") from None
        except ImageTooLarge as e:
            raise bad_request(f"the image is too large: {e}", PARAM, "image_too_large") from None
        except (DecodeTimeout, DecoderCrashed) as e:
            code = "decode_timeout" if isinstance(e, DecodeTimeout) else "decoder_crashed"
            raise bad_request(f"the image could not be decoded: {e}", PARAM, code) from None
        except ImageError as e:
            raise bad_request(f"the image could not be decoded: {e}", PARAM,
                              "invalid_image") from None


def _key(url: str) -> bytes:
    return xxhash.xxh3_128_digest(url.encode("utf-8", "surrogatepass"))


def _size(image: PreparedImage) -> int:
    return image.tiles.nbytes + (image.pixels.nbytes if image.pixels is not None else 0)
