"""Stage 1's workers: where each image of a group is read, decoded and prepared, for the
drive loop (``drive.py``; import them from here).

    preparer(plan, opts)   the workers ``PrepareOptions`` asks for, behind ``PrepareWorkers``:
        _Fetching              the fetch stage (``preprocessing/fetch.py``: remote images,
                               table rows and shard members read ``opts.fetch.concurrency``
                               at once) handing bytes to
            _ProcessPreparer   decoder processes, each image under ``decode_timeout``
                               (``preprocessing/isolated.py``), or
            _ThreadPreparer    threads of this process (``decode_timeout`` 0)
    prepare_item(ref, plan)    one image in this thread (the serial path, a Ray prepare task)

An item of several images (``ImageList``) is each image submitted so, joined into one
``MediaItem`` once all are prepared (the first failure, in order, its error); a clip
(``VideoSource``, its plan bound by ``AnswerTask``) goes to a decoder process like an image,
under the same deadline (a remote one's bytes fetched first), and comes back as its
``MediaItem``.

A failure is a ``SourceError`` (kind ``source``) or an ``ImageError`` (``decode``,
``too_large``, ``decode_timeout``, ``decoder_crashed``): ``item_error`` makes it that item's
``ItemError``. Light (no torch): a Ray prepare worker imports it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

import numpy as np

from vlmbatch.engine.records import Item, MediaItem
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.media_inputs import ImageList, VideoInput, check_images
from vlmbatch.pipeline.parts import PartedItem, as_item, each_alone
from vlmbatch.pipeline.records import ErrorKind, ImageSource, ItemError
from vlmbatch.pipeline.task import ImageRef
from vlmbatch.preprocessing.decode import ImageError, ImageTooLarge
from vlmbatch.preprocessing.fetch import DaemonPool, Fetcher
from vlmbatch.preprocessing.isolated import DecoderCrashed, DecoderPool, DecodeTimeout
from vlmbatch.preprocessing.limits import DEFAULT_MAX_PIXELS
from vlmbatch.preprocessing.media import MediaPart, WindowedClip
from vlmbatch.preprocessing.prepare import ImagePlan, prepare_bytes
from vlmbatch.preprocessing.sources import SourceError, is_remote, read_bytes
from vlmbatch.preprocessing.video_source import VideoSource


def list_refused(image: object) -> ImageError | SourceError | None:
    """An ``ImageList`` whose count is out of bounds, as its item's error (the run going on):
    empty (``SourceError``: nothing to read) or over ``MAX_IMAGES`` (``ImageTooLarge``), the
    limit named; None for anything else. Checked before any of its images is fetched."""
    if not isinstance(image, ImageList):
        return None
    try:
        check_images(image.images, "images")
    except ValueError as e:
        return ImageTooLarge(str(e)) if image.images else SourceError(str(e))
    return None


def prepare_item(ref: ImageRef, plan: ImagePlan, max_pixels: int = DEFAULT_MAX_PIXELS,
                 fetcher: Fetcher | None = None) -> Item:
    """Read (a remote image through ``fetcher``, else a fetcher of default options made for
    it), decode, prepare; raises SourceError or ImageError with the reason. Several images or
    a clip: a ``MediaItem`` of their parts, in order; a per-image list or a clip in windows:
    a ``PartedItem`` (``parts.py``)."""
    if (refused := list_refused(ref.image)) is not None:
        raise refused
    if isinstance(ref.image, ImageList):
        parts = [prepare_part(dataclasses.replace(ref, image=s), plan, max_pixels, fetcher)
                 for s in ref.image.images]
        return each_alone(parts) if ref.image.per_image else _media(parts)
    return as_item(prepare_part(ref, plan, max_pixels, fetcher))


def prepare_part(ref: ImageRef, plan: ImagePlan, max_pixels: int = DEFAULT_MAX_PIXELS,
                 fetcher: Fetcher | None = None) -> MediaPart | WindowedClip:
    """One image (``prepare_item``), or one clip by its ``VideoSource``'s plan (in windows:
    a ``WindowedClip``)."""
    src = ref.image
    if isinstance(src, VideoInput):
        raise ImageError("this engine takes no clips (the torch engine does: --engine torch)")
    if isinstance(src, VideoSource):
        return src.plan.prepare(_read(src.source, ref, fetcher), max_pixels)
    if isinstance(src, np.ndarray):  # decoded pixels (the Python API)
        if src.ndim != 3 or src.shape[2] != 3 or src.dtype != np.uint8:
            raise ImageError(f"an image array must be uint8 RGB [H, W, 3], got {src.dtype} "
                             f"{list(src.shape)}")
        if src.shape[0] * src.shape[1] > max_pixels:
            raise ImageTooLarge(f"image is {src.shape[1]}x{src.shape[0]} pixels, over the "
                                f"limit of {max_pixels:,} (raise --max-pixels to allow it)")
        return plan.prepare(src)
    assert not isinstance(src, ImageList)
    return prepare_bytes(_read(src, ref, fetcher), plan, max_pixels)


def _read(src: ImageSource, ref: ImageRef, fetcher: Fetcher | None) -> bytes:
    if isinstance(src, bytes):
        return src
    if isinstance(src, str) and not is_remote(src):
        return read_bytes(src, ref.base_dir)
    if fetcher is None:  # a remote image, a table row or a shard member
        with Fetcher() as own:
            return own.fetch(src, ref.base_dir)
    return fetcher.fetch(src, ref.base_dir)


def item_error(ref: ImageRef, e: SourceError | ImageError) -> ItemError:
    """Why the image of ``ref`` could not be prepared, with its kind."""
    kind = (ErrorKind.SOURCE if isinstance(e, SourceError) else
            ErrorKind.TOO_LARGE if isinstance(e, ImageTooLarge) else
            ErrorKind.DECODE_TIMEOUT if isinstance(e, DecodeTimeout) else
            ErrorKind.DECODER_CRASHED if isinstance(e, DecoderCrashed) else ErrorKind.DECODE)
    return ItemError(kind, f"{ref.source}: {e}")


def prepare_hooked(ref: ImageRef, plan: ImagePlan, max_pixels: int,
                   hooks: FaultHooks) -> Item:
    hooks.prepare(ref)
    return prepare_item(ref, plan, max_pixels)


def preparer(plan: ImagePlan, opts: PrepareOptions,
             hooks: FaultHooks = NO_HOOKS) -> PrepareWorkers | None:
    """The workers ``opts`` asks for: decoder processes (``decode_timeout > 0``), threads,
    or None (``threads == 0`` and no deadline: each group prepared in the caller's thread).
    Each starts its processes with the first image; ``stop`` ends them. Remote images go
    through a fetch stage first (``_Fetching``), which hands their bytes to the workers."""
    inner: _ThreadPreparer | _ProcessPreparer
    if opts.decode_timeout > 0:
        inner = _ProcessPreparer(max(opts.threads, 1), plan, opts.max_pixels,
                                 opts.decode_timeout, hooks)
    elif opts.threads:
        inner = _ThreadPreparer(opts.threads, plan, opts.max_pixels, hooks)
    else:
        return None
    return _Fetching(inner, Fetcher(opts.fetch))


def prepare_now(ref: ImageRef, plan: ImagePlan, opts: PrepareOptions,
                workers: PrepareWorkers | None) -> Item:
    """One image prepared on ``workers`` (a decoder process: under the deadline), else in
    this thread; raises ``SourceError``/``ImageError`` (``DecodeTimeout``,
    ``DecoderCrashed`` included) with the reason."""
    if workers is None:
        with Fetcher(opts.fetch) as fetcher:  # its threads and client start only if used
            return prepare_item(ref, plan, opts.max_pixels, fetcher)
    return workers.submit(ref).result()


def outcome(ref: ImageRef, f: Future) -> Item | ItemError:
    try:
        return f.result()
    except (SourceError, ImageError) as e:
        return item_error(ref, e)


class PrepareWorkers(Protocol):
    """Stage-1 workers: ``submit`` an image, get its ``PreparedImage`` in a future (or its
    ``SourceError``/``ImageError``); ``fetch`` a remote image's bytes ahead of that (the
    drive's look-ahead, ``drive.prepared_groups``); thread-safe."""

    def fetch(self, ref: ImageRef) -> Future: ...

    def submit(self, ref: ImageRef, fetched: Future | None = None) -> Future: ...

    def stop(self) -> None: ...


class _Fetching:
    """The fetch stage ahead of ``inner``: a remote image (``sources.is_remote``) is fetched
    on ``fetcher``'s threads, many at once, and its bytes handed to ``inner`` (so a decoder
    process's deadline measures decoding alone); other images go to ``inner`` at once.
    Cancelling a submitted image's future cancels its fetch too, if not started."""

    def __init__(self, inner: _ThreadPreparer | _ProcessPreparer, fetcher: Fetcher) -> None:
        self.inner, self.fetcher = inner, fetcher
        self.warm = False

    def fetch(self, ref: ImageRef) -> Future:
        """The bytes of ``ref``'s remote image, read now; the first one also starts the
        decoder processes, so that they start while the bytes travel, not after."""
        if not self.warm:
            self.warm = True
            self.inner.start()
        return self.fetcher.submit(ref.image, ref.base_dir)

    def submit(self, ref: ImageRef, fetched: Future | None = None) -> Future:
        """``ref``'s ``PreparedImage``; ``fetched``: its bytes being read already
        (``fetch``), else a remote image is fetched first. Several images: each submitted so,
        their ``MediaItem`` when all are done; a clip: its ``MediaItem``, a remote one's bytes
        fetched first."""
        src = ref.image
        if (refused := list_refused(src)) is not None:
            out: Future = Future()
            out.set_exception(refused)
            return out
        if isinstance(src, ImageList):
            return _joined([self.submit(dataclasses.replace(ref, image=s)) for s in src.images],
                           each_alone if src.per_image else _media)
        if isinstance(src, VideoSource):
            if not is_remote(src.source):
                return _joined([self.inner.submit(ref)])
            data = self.fetch(dataclasses.replace(ref, image=src.source))
            return _joined([self._after(ref, _mapped(
                data, lambda b: dataclasses.replace(src, source=b)))])
        if fetched is None:
            if not is_remote(ref.image):
                return self.inner.submit(ref)
            fetched = self.fetch(ref)
        return self._after(ref, fetched)

    def _after(self, ref: ImageRef, fetched: Future) -> Future:
        out: Future = Future()
        out.add_done_callback(lambda o: o.cancelled() and fetched.cancel())
        fetched.add_done_callback(lambda f: self._fetched(ref, f, out))
        return out

    def _fetched(self, ref: ImageRef, f: Future, out: Future) -> None:
        if out.cancelled():
            return
        if f.cancelled() or f.exception() is not None:
            return _settle(out, f)
        prepared = self.inner.submit(dataclasses.replace(ref, image=f.result()))
        prepared.add_done_callback(lambda p: _settle(out, p))

    def stop(self) -> None:
        self.fetcher.stop()
        self.inner.stop()


def _mapped(f: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(f.result())`` (``f``'s exception or cancellation as it is)."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled() or f.exception() is not None:
            return _settle(out, f)
        try:
            out.set_result(fn(f.result()))
        except InvalidStateError:
            pass

    f.add_done_callback(done)
    return out


def _media(results: list[Any]) -> Item:
    """Prepared parts (in order) as one item: a clip's windows as its ``PartedItem``, else
    the ``MediaItem`` of them all (``_parts``)."""
    if len(results) == 1 and isinstance(results[0], (WindowedClip, PartedItem)):
        return as_item(results[0])
    return MediaItem(tuple(x for r in results for x in _parts(r)))


def _joined(parts: list[Future], join: Callable[[list[Any]], Any] = _media) -> Future:
    """A future of ``join`` of ``parts``' results in order (their ``MediaItem``), once all
    are done; the first failure (in order) if any fails; cancelling it cancels them all."""
    out: Future = Future()
    out.add_done_callback(lambda o: o.cancelled() and [p.cancel() for p in parts])
    left = [len(parts)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        bad = next((p for p in parts if p.cancelled() or p.exception() is not None), None)
        if bad is not None:
            return _settle(out, bad)
        try:
            out.set_result(join([p.result() for p in parts]))
        except InvalidStateError:
            pass  # cancelled by its caller

    for p in parts:
        p.add_done_callback(done)
    return out


def _parts(prepared: MediaPart | MediaItem) -> list[MediaPart]:
    """A worker's result as parts: a clip prepared in this process comes as its
    ``MediaItem`` (``prepare_item``), one from a decoder process as the clip."""
    return list(prepared.parts) if isinstance(prepared, MediaItem) else [prepared]


def _settle(out: Future, f: Future) -> None:
    """``out`` given ``f``'s outcome, unless ``out`` was cancelled meanwhile."""
    try:
        if f.cancelled():
            out.cancel()
        elif (e := f.exception()) is not None:
            out.set_exception(e)
        else:
            out.set_result(f.result())
    except InvalidStateError:
        pass  # cancelled by its caller


class _ThreadPreparer:
    def __init__(self, threads: int, plan: ImagePlan, max_pixels: int,
                 hooks: FaultHooks) -> None:
        self.pool = DaemonPool(threads)
        self.args = plan, max_pixels, hooks

    def submit(self, ref: ImageRef) -> Future:
        return self.pool.submit(prepare_hooked, ref, *self.args)

    def start(self) -> None:
        pass  # threads: started already

    def stop(self) -> None:
        self.pool.stop()


class _ProcessPreparer:
    """Decoder processes for encoded images (paths, URLs, bytes); decoded pixels (the
    Python API's arrays) need no decoder and are tiled here, at once (as is a table row or
    shard member that reached it unfetched: ``_Fetching`` normally reads those first)."""

    def __init__(self, workers: int, plan: ImagePlan, max_pixels: int, timeout_s: float,
                 hooks: FaultHooks) -> None:
        self.pool = DecoderPool(workers, plan, max_pixels, timeout_s, hooks.before_prepare)
        self.plan, self.max_pixels = plan, max_pixels

    def submit(self, ref: ImageRef) -> Future:
        if isinstance(ref.image, (str, bytes, VideoSource)):
            return self.pool.submit(ref.image, ref.base_dir)
        f: Future = Future()
        try:
            f.set_result(prepare_item(ref, self.plan, self.max_pixels))
        except (SourceError, ImageError) as e:
            f.set_exception(e)
        return f

    def start(self) -> None:
        self.pool.start()

    def stop(self) -> None:
        self.pool.stop()
