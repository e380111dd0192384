"""A chat request's image: checked against the media policy, then read, decoded and tiled
in one of the server's decoder processes while the request's worker thread waits (each
image under ``--decode-timeout``: one that hangs or crashes its decoder is that request's
400, and the server goes on; a bad image likewise), and kept in a small LRU by the xxh3 hash
of its ``data:`` URL (at most ``budget`` bytes of tiles), so clients that send the same image
again (the usual case: several questions about one image) skip its decode. ``file://``
images are read each time (the file may change).

The engine's prefix cache is keyed by pixels, not by URL: two different URLs of the same
pixels still share their cached prefix; this cache only saves the decode.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

from vlmbatch.app.server.errors import bad_request
from vlmbatch.app.server.media import MediaRefused, check_image_url
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import Preparer, prepare_now
from vlmbatch.pipeline.records import ImageItem
from vlmbatch.pipeline.task import ImageRef
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecodeTimeout
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage
from vlmbatch.preprocessing.sources import SourceError

PARAM = "messages"


class ImageCache:
    def __init__(self, plan: ImagePlan, opts: PrepareOptions, allowed: Path | None,
                 budget: int, workers: Preparer | None) -> None:
        """``workers``: the server's decoder processes for ``plan`` (None: decode on the
        request's thread, ``--decode-timeout 0``)."""
        self.plan, self.opts, self.allowed, self.budget = plan, opts, allowed, budget
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
            url = check_image_url(item.image, self.allowed)
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
