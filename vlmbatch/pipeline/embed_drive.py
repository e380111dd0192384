"""The drive loop for embeddings, the counterpart of ``pipeline/drive.py``: items -> prepared
groups -> one embedder call per group -> one ``Embedding`` per item.

Stage 1 (CPU) is ``drive.py``'s own: the items that have an image go through
``prepare_group``/``prepared_groups`` as image items (same threads, same errors per item);
text-only items need none. Stage 2 (``embed_group``) asks the embedder for the group's
vectors in one call; an engine failure fails that group's items with kind ``engine``. The
CLI, the Python API and embedding jobs (in-process and Ray) all embed through these.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass

# re-exported: inputs per embedder call by default, defined with the configs (the CLI's)
from vlmbatch.pipeline.config import EMBED_GROUP as EMBED_GROUP
from vlmbatch.pipeline.drive import PreparedGroup, prepare_group, prepared_groups
from vlmbatch.pipeline.embed import Embedder
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.records import (
    Embedding,
    EmbedItem,
    EmbedRequest,
    ErrorKind,
    ImageItem,
    ItemError,
)
from vlmbatch.preprocessing.decode import DEFAULT_MAX_PIXELS
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage


@dataclass
class PreparedEmbedGroup:
    """Stage 1 of a group of embedding inputs: ``images`` holds the group's items that have an
    image (as image items keyed by ``EmbedItem.key``), prepared or failed."""
    group: list[EmbedItem]
    images: PreparedGroup

    @classmethod
    def failed(cls, item: EmbedItem, err: ItemError) -> PreparedEmbedGroup:
        """A one-item group whose preparation failed (a Ray prepare task that hung or died)."""
        return cls([item], PreparedGroup(_image_items([item]), [None], {item.key: err}))


def _image_items(group: list[EmbedItem]) -> list[ImageItem]:
    return [ImageItem(it.key, it.image, (), it.base_dir) for it in group if it.image is not None]


def prepare_embed_group(group: list[EmbedItem], plan: ImagePlan,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> PreparedEmbedGroup:
    return PreparedEmbedGroup(group, prepare_group(_image_items(group), plan, max_pixels))


def prepared_embed_groups(groups: Iterable[list[EmbedItem]], plan: ImagePlan, max_pixels: int,
                          threads: int, decode_timeout: float = 0.0,
                          hooks: FaultHooks = NO_HOOKS
                          ) -> Generator[PreparedEmbedGroup, None, None]:
    """``groups`` prepared, in order, on ``threads`` preprocessing threads working ahead, or
    in decoder processes under ``decode_timeout`` (``drive.prepared_groups``: its bounds on
    memory, its per-item deadline and its behaviour on close apply)."""
    pulled: deque[list[EmbedItem]] = deque()  # groups handed to the preparer, in order

    def image_groups() -> Iterator[list[ImageItem]]:
        for g in groups:
            pulled.append(g)
            yield _image_items(g)

    with closing(prepared_groups(image_groups(), plan, max_pixels, threads,
                                 decode_timeout=decode_timeout, hooks=hooks)) as prepared:
        for pg in prepared:
            yield PreparedEmbedGroup(pulled.popleft(), pg)


def embed_group(embedder: Embedder, peg: PreparedEmbedGroup) -> list[Embedding]:
    """Stage 2 of a group: one ``Embedding`` per item, in order (failed items carry why)."""
    pg = peg.images
    errors = dict(pg.errors)
    prepared: list[PreparedImage] = []
    index: dict[str, int] = {}
    for it, im in zip(pg.group, pg.images):
        if im is not None:
            index[it.id] = len(prepared)
            prepared.append(im)
    todo = [it for it in peg.group if it.image is None or it.key in index]
    requests = [EmbedRequest(None if it.image is None else index[it.key], it.text)
                for it in todo]
    try:
        vectors = dict(zip((it.key for it in todo), embedder.embed(prepared, requests)))
    except Exception as e:  # noqa: BLE001  (e.g. out of memory: fail this group, not the run)
        keys = [it.key for it in peg.group]
        print(f"vlmbatch: engine failed on inputs {keys}: {type(e).__name__}: {e}",
              file=sys.stderr)
        failed = ItemError(ErrorKind.ENGINE, f"engine failed: {type(e).__name__}: {e}")
        errors.update({k: failed for k in keys if k not in errors})
        vectors = {}
    return [Embedding.of(it, vectors[it.key]) if it.key in vectors
            else Embedding.failed(it, errors[it.key]) for it in peg.group]
