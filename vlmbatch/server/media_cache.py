"""``MediaCache``: a chat image paid for once. Keyed by the content hash of the image's
bytes (xxh3-128) and confirmed by comparing the bytes themselves (two different images
never share an entry, whatever their hashes), it keeps each image's ``PreparedImage``, so
the second and later requests about an image skip reading it from a decoder process,
decoding and tiling; and since they hand the engines the same prepared image (the same
cache key), the engine's prefix cache spares them its vision encoder and image prefill.

- ``read(url)``: the image's bytes, the URL checked first (``media.check_image_url``): a
  ``data:`` URL's payload, a file's bytes, or an http(s) image fetched under the SSRF guard
  (and what a decoder process is to read on a miss: the URL itself, or those fetched
  bytes).
- ``get(data)``: the prepared image of these bytes if cached (a hit), else None.
- ``prepare(data, source)``: the prepared image, decoded in one of the server's decoder
  processes on a miss (under ``--decode-timeout``: an image that hangs or crashes its
  decoder is that request's 400). Concurrent misses of the same bytes decode once: the
  first decodes, the others wait for it (a client sending several questions about a new
  image at once is the usual case).

Bounded by ``budget`` bytes (an entry counts its encoded bytes and its arrays; the least
recently used go first; an image over the budget is not kept). ``stats()`` counts hits
(requests served without decoding), misses (requests that decoded), evictions and bytes
held, for ``/metrics``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import xxhash

from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.preparers import PrepareWorkers, prepare_now
from vlmbatch.pipeline.task import ImageRef, stills
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.fetch import Fetcher
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecodeTimeout
from vlmbatch.preprocessing.limits import MediaGuard
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage
from vlmbatch.preprocessing.sources import SourceError, read_bytes
from vlmbatch.server.errors import bad_request
from vlmbatch.server.media import MediaRefused, check_image_url

PARAM = "messages"
ROOT_DIR = Path("/")  # base folder of a request's image: unused (bare paths are refused)
Hash = Callable[[bytes], bytes]


@dataclass(frozen=True)
class MediaCacheStats:
    hits: int  # requests whose image was served without decoding
    misses: int  # requests that decoded their image
    evictions: int  # entries dropped to stay within the budget
    bytes: int  # held now: encoded bytes and prepared arrays
    entries: int


@dataclass
class _Entry:
    data: bytes  # the encoded image, compared on every hit
    image: PreparedImage
    size: int


def _size(data: bytes, image: PreparedImage) -> int:
    return len(data) + image.rows.nbytes + (image.pixels.nbytes if image.pixels is not None
                                            else 0)


class MediaCache:
    def __init__(self, plan: ImagePlan, opts: PrepareOptions, allowed: Path | None,
                 budget: int, workers: PrepareWorkers | None, remote: MediaGuard | None = None,
                 hash_fn: Hash = xxhash.xxh3_128_digest) -> None:
        """``workers``: the server's decoder processes for ``plan`` (None: decode on the
        request's thread, ``--decode-timeout 0``); ``remote``: http(s) URLs allowed, under
        this guard (``opts.fetch.guard`` checks their connections); ``hash_fn``: the
        content hash (tests give a colliding one)."""
        self.plan, self.opts, self.allowed, self.budget = plan, opts, allowed, budget
        self.workers, self.remote, self.hash = workers, remote, hash_fn
        self.fetcher = Fetcher(opts.fetch)  # http(s) images; its client starts on first use
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._decoding: dict[bytes, tuple[bytes, Future[PreparedImage]]] = {}
        self._lock = threading.Lock()
        self._bytes = self.hits = self.misses = self.evictions = 0

    # --- reading ---
    def read(self, url: str) -> tuple[str | bytes, bytes]:
        """What a decoder process reads for the image (its checked ``data:`` or ``file://``
        URL, or an http(s) image's fetched bytes) and the image's bytes (a 400 if the URL
        may not be read, or cannot be)."""
        try:
            checked = check_image_url(url, self.allowed, self.remote)
        except MediaRefused as e:
            raise bad_request(str(e), PARAM, "invalid_image_url") from None
        try:
            if not self.fetcher.needs(checked):
                data = read_bytes(checked, ROOT_DIR)
                source: str | bytes = checked
            else:
                data = source = self.fetcher.fetch(checked, ROOT_DIR)
        except SourceError as e:
            raise bad_request(f"the image could not be read: {e}", PARAM,
                              "invalid_image_url") from None
        if not data:
            raise bad_request("the image is empty", PARAM, "invalid_image")
        return source, data

    def reads_inline(self, url: str) -> bool:
        """Whether ``read(url)`` is cheap enough for the event loop (a ``data:`` URL)."""
        return url.startswith("data:")

    # --- the cache ---
    def get(self, data: bytes) -> PreparedImage | None:
        """The prepared image of ``data`` if cached (counted as a hit)."""
        key = self.hash(data)
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.data != data:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return e.image

    def prepare(self, data: bytes, source: str | bytes | None = None) -> PreparedImage:
        """The prepared image of ``data``: from the cache, from a decode of the same bytes
        in flight, or decoded (``source``: what the decoder reads, ``read``'s first value;
        None: ``data`` itself)."""
        key = self.hash(data)
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.data == data:
                self._entries.move_to_end(key)
                self.hits += 1
                return e.image
            flight = self._decoding.get(key)
            if flight is not None and flight[0] == data:
                self.hits += 1
                waiting: Future[PreparedImage] | None = flight[1]
            else:
                waiting = None
                self.misses += 1
                mine: Future[PreparedImage] = Future()
                if flight is None:  # a different image with the same hash decodes alone
                    self._decoding[key] = (data, mine)
        if waiting is not None:
            return waiting.result()
        try:
            image = self._decode(data if source is None else source)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                if self._decoding.get(key, (b"", None))[1] is mine:
                    del self._decoding[key]
        mine.set_result(image)
        self._keep(key, data, image)
        return image

    def _keep(self, key: bytes, data: bytes, image: PreparedImage) -> None:
        size = _size(data, image)
        if size > self.budget:
            return
        with self._lock:
            old = self._entries.get(key)
            if old is not None:  # a colliding image, or the same one decoded twice
                self._bytes -= old.size
            self._entries[key] = _Entry(data, image, size)
            self._entries.move_to_end(key)
            self._bytes += size
            while self._bytes > self.budget:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size
                self.evictions += 1

    def joined(self) -> None:
        """A request served by a decode another request started (counted as a hit)."""
        with self._lock:
            self.hits += 1

    def stats(self) -> MediaCacheStats:
        with self._lock:
            return MediaCacheStats(self.hits, self.misses, self.evictions, self._bytes,
                              len(self._entries))

    def _decode(self, source: str | bytes) -> PreparedImage:
        name = source[:80] if isinstance(source, str) else "the image"
        try:
            return stills([prepare_now(ImageRef(source, ROOT_DIR, name), self.plan,
                                       self.opts, self.workers)])[0]
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

    def stop(self) -> None:
        self.fetcher.stop()

