"""Items asked part by part: a clip in windows (``segment_seconds``), a list of images each
asked alone (``"per_image": true``, ``vlmbatch.each_image``). Stage 1 makes such an item a
``PartedItem``; stage 2 (``AnswerTask.run``) fans it out, one engine item per part, every
question asked of every part, and reduces the parts' answers to one per question.

Lines of a parted item, in order (``Answer.line``; ``PART_KEYS`` in ``records.py``):

- one per (part, question), parts in order, each part's questions in the item's order:
  the part's own answer, with ``part`` (its index from 0) and ``window`` (``[start_s,
  end_s]``, with the window's ``frames``/``seconds``) or ``image`` (the image's index);
- then one per question for the whole item, ``any`` semantics: the answer of the part
  that answers most surely, with ``parts`` (how many), ``trigger`` (that part's index) and
  ``trigger_window`` or ``trigger_image``. Yes/no: the part of the highest ``p_yes`` (the
  first of equals), so the item says yes iff some part says yes and its ``p_yes`` is the
  max over parts; its ``margin``, ``image_tokens``, ``frames``/``seconds`` (a window's) and
  ``text`` are that part's. A label set: the part whose most probable choice is most
  probable; its ``label``, ``probs`` and ``logprobs``.

Readers of result lines (``labels/read.py``: eval, calibrate, report) skip part lines (they
have ``part``) and read the item's lines as any other; a failed item (its clip unreadable)
has one failed line per question and no part line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmbatch.engine.records import Item, MediaItem
from vlmbatch.pipeline.records import Answer, ImageItem, ItemError, request_of
from vlmbatch.preprocessing.media import MediaPart, PreparedVideo, WindowedClip

if TYPE_CHECKING:
    from vlmbatch.engine.base import Engine


@dataclass(frozen=True, eq=False)
class PartedItem(MediaItem):
    """An item's parts, each asked every question alone: ``items[k]`` is part ``k``'s engine
    item; ``windows[k]`` its ``(start, end)`` seconds (a clip's windows), or None for the
    images of a per-image list (part ``k`` is image ``k``). A ``MediaItem`` of all the
    parts' parts in order (``parted``), so that stage 1's records stay ``Item``s; a caller
    that takes it as a ``MediaItem`` asks one prompt of them all, ``AnswerTask`` asks each
    part alone (``run_answers``)."""
    items: tuple[Item, ...] = ()
    windows: tuple[tuple[float, float], ...] | None = None


def parted(items: tuple[Item, ...], windows: tuple[tuple[float, float], ...] | None = None,
           ) -> PartedItem:
    """The ``PartedItem`` of ``items`` (each a still image or a ``MediaItem``)."""
    parts = tuple(p for it in items for p in (it.parts if isinstance(it, MediaItem) else (it,)))
    return PartedItem(parts, items, windows)


def as_item(prepared: MediaPart | WindowedClip | Item) -> Item:
    """A prepared clip or image as stage 1 hands it on: a clip's windows as a
    ``PartedItem``, a clip as its ``MediaItem``, anything else as it is."""
    if isinstance(prepared, WindowedClip):
        return parted(tuple(MediaItem((v,)) for v in prepared.videos), prepared.windows)
    if isinstance(prepared, PreparedVideo):
        return MediaItem((prepared,))
    return prepared


def each_alone(results: Sequence[MediaPart | WindowedClip | Item]) -> PartedItem:
    """A per-image list's prepared images (in order) as its parts."""
    return parted(tuple(as_item(r) for r in results))


def run_answers(engine: Engine, items: list[ImageItem], images: list[Item | None],
                errors: dict[str, ItemError]) -> list[list[Answer]]:
    """Stage 2 of a group some of whose items are parted (module docstring): one
    ``Engine.score`` call for every part and item, then each item's answers."""
    flat: list[Item] = []
    spans: dict[str, range] = {}
    for it, im in zip(items, images):
        if im is not None:
            subs = im.items if isinstance(im, PartedItem) else (im,)
            spans[it.id] = range(len(flat), len(flat) + len(subs))
            flat.extend(subs)
    requests = [request_of(k, q) for it in items if it.id in spans for k in spans[it.id]
                for q in it.questions]
    scores = iter(engine.score(flat, requests))
    out = []
    for it, im in zip(items, images):
        if it.id not in spans:
            out.append([Answer.failed(it.id, q, errors[it.id]) for q in it.questions])
            continue
        got = [[Answer.scored(it.id, q, next(scores)).seen(flat[k]) for q in it.questions]
               for k in spans[it.id]]
        out.append(got[0] if not isinstance(im, PartedItem) else reduced(im.windows, got))
    return out


def reduced(windows: tuple[tuple[float, float], ...] | None,
            per_part: list[list[Answer]]) -> list[Answer]:
    """A parted item's lines from its parts' answers (``per_part[k][j]``: part ``k``,
    question ``j``; ``windows``: the parts' seconds, None: images): the part lines (each
    tagged with its part) and then one line per question (module docstring)."""
    def tag(k: int) -> dict:
        if windows is None:
            return {"image": k}
        return {"window": windows[k]}

    lines = [dataclasses.replace(a, part=k, **tag(k))
             for k, answers in enumerate(per_part) for a in answers]
    for j in range(len(per_part[0])):
        k = max(range(len(per_part)), key=lambda k: (_sureness(per_part[k][j]), -k))
        trigger = ({"trigger_image": k} if windows is None
                   else {"trigger_window": windows[k]})
        lines.append(dataclasses.replace(per_part[k][j], parts=len(per_part), trigger=k,
                                         **trigger))
    return lines


def _sureness(a: Answer) -> float:
    """How surely a part answers (what the item's line maximises): ``p_yes``; a label
    set's probability of its most probable choice."""
    if a.choices:
        return max((a.probs or {}).values(), default=0.0)
    return a.p_yes if a.p_yes is not None else -1.0
