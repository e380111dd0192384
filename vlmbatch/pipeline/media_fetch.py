"""The remote sources of an item's media (a still image, the images of an ``ImageList``, a
clip's ``VideoSource``), fetched through one ``Fetcher`` at once, for the serial stage 1
(``drive.prepare_group``: a run without workers, a Ray prepare task), so that the images of a
list and a remote clip are read with the run's fetch options as a single image is; and how
many images and clips an item holds (what a decode deadline is counted per).

Light (no torch, no decoder): a Ray prepare worker imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vlmbatch.pipeline.media_inputs import ImageList
from vlmbatch.pipeline.task import ImageRef
from vlmbatch.preprocessing.fetch import Fetcher
from vlmbatch.preprocessing.sources import is_remote
from vlmbatch.preprocessing.video_source import VideoSource


def has_remote(image: object) -> bool:
    """Whether any source of ``image`` (an image, each image of a list, a clip) is read by the
    fetch stage (``sources.is_remote``)."""
    if isinstance(image, ImageList):
        return any(is_remote(s) for s in image.images)
    if isinstance(image, VideoSource):
        return is_remote(image.source)
    return is_remote(image)


def media_count(ref: ImageRef | None) -> int:
    """How many images and clips stage 1 decodes for an item: a list's length, else 1 (an
    item without an image counts 1, as before lists: its deadline share is unchanged)."""
    return len(ref.image.images) if ref is not None and isinstance(ref.image, ImageList) else 1


def fetch_ahead(ref: ImageRef, fetcher: Fetcher) -> Callable[[], ImageRef]:
    """Each remote source of ``ref`` submitted to ``fetcher`` now; the returned call waits for
    them and gives ``ref`` with their bytes in place (raises the first ``SourceError``, in
    order). Local paths, bytes and arrays are left for the preparer to read."""
    src = ref.image
    if isinstance(src, ImageList):
        parts: list[Any] = [fetcher.submit(s, ref.base_dir) if is_remote(s) else s
                            for s in src.images]
        return lambda: dataclasses.replace(ref, image=ImageList(tuple(
            p.result() if isinstance(p, Future) else p for p in parts)))
    if isinstance(src, VideoSource):
        clip = fetcher.submit(src.source, ref.base_dir)
        return lambda: dataclasses.replace(ref, image=dataclasses.replace(
            src, source=clip.result()))
    data = fetcher.submit(src, ref.base_dir)
    return lambda: dataclasses.replace(ref, image=data.result())
