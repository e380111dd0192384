"""Records passed between stages (frozen dataclasses, never loose dicts).

    ImageItem(questions: Question...) --prepare--> PreparedImage (preprocessing/)
        --Request per question--> engine --Score--> Answer (one per image x question)

``Answer`` is what the engine side hands to sinks: the JSONL line, the CSV and Parquet
columns, the OpenAI batch output and the Python API's results are all derived from it, in
``Answer.line`` / ``Answer.COLUMNS``. A failed answer carries its ``ErrorKind`` as well as
the message, so nothing downstream matches message text.

Two kinds of question: yes/no (``p_yes`` against the question's threshold) and label sets
(``Question.choices``: the most probable choice is the ``label``, with ``probs`` normalised
over the choices and each choice's ``logprobs``, the log-likelihood of its whole token
sequence after the prompt). A question may carry a system turn and an instruction placed
before its text (``system``, ``prompt``): the family's chat template renders them.

Embeddings (``engine/embed.py``)::

    EmbedItem (image, text or both) --prepare--> PreparedImage (if any)
        --EmbedRequest--> EmbedHandle --Vector--> Embedding (one per item)
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Union

import numpy as np

from vlmbatch.engine.records import Request, Score, Vector
from vlmbatch.pipeline.media_inputs import ImageList, VideoInput, check_images
from vlmbatch.pipeline.questions import ManifestError, Question, check_id, questions_of
from vlmbatch.preprocessing.media import PreparedVideo
from vlmbatch.preprocessing.sources import MemberRef, NotAnImage, RowRef

if TYPE_CHECKING:
    import PIL.Image

# an image as an item may hold it: a path (relative to ``base_dir``), a file://, data:,
# http(s):// or s3/gs/az URL (strings: what a manifest or a job store holds), a table's row or
# a shard's member (``preprocessing/sources.py``: what a job over a Parquet file or WebDataset
# shards stores), encoded bytes, or decoded uint8 RGB pixels [H, W, 3] (the Python API)
# (or, from the Python API only, ``NotAnImage``: what it was given instead, the item's error)
ImageSource = str | bytes | np.ndarray | RowRef | MemberRef | NotAnImage
# what ImageItem takes: those, a Path, or a PIL image (converted: image_source)
ImageLike = Union[ImageSource, Path, "PIL.Image.Image"]
# what an item asks about: one image, several in one prompt, or a clip (``media_inputs.py``)
ItemMedia = ImageSource | ImageList | VideoInput
QuestionsLike = Sequence[str | dict | Question] | str | dict | Question
# PIL's Transpose values (an IntEnum) for each EXIF orientation that is not upright
_UPRIGHT = {2: 0, 3: 3, 4: 1, 5: 5, 6: 4, 7: 6, 8: 2}


@dataclass(frozen=True, init=False)
class ImageItem:
    """An image and the questions asked about it, built from what a user has::

        ImageItem("s2", "photos/a.jpg", ["Is there a red shape?",
                                         {"id": "c", "text": "A circle?", "threshold": 0.7}])

    ``image``: a path (a str or a ``Path``, relative to ``base_dir``), a URL, encoded bytes,
    a PIL image (EXIF orientation applied, converted to RGB) or a uint8 array ``[H, W, 3]``
    (gray ``[H, W]`` and RGBA ``[H, W, 4]`` converted as Pillow's ``convert("RGB")``
    would), kept as ``image_source`` says; readers pass a table's ``RowRef`` or a shard's
    ``MemberRef``. ``questions``: one or a sequence of strings, question objects (dicts, as
    in a manifest: ``pipeline/questions.py``) or ``Question``s, kept as a tuple of
    ``Question``s (a malformed one: ``ManifestError`` naming the item). ``id``: a string or
    a whole number (kept as text). ``base_dir``: the current folder when not given. The
    fields hold the kept forms; readers and job stores pass them, at no cost.

    ``image`` may also be a list of images (one prompt holding them in order: an
    ``ImageList``, each converted as above, 1 to ``MAX_IMAGES``) or a ``VideoInput`` (a clip
    and its sampling keys)."""
    id: str
    image: ItemMedia
    questions: tuple[Question, ...]
    base_dir: Path  # relative paths resolve against this

    def __init__(self, id: str | int,  # noqa: A002
                 image: ImageLike | ImageList | VideoInput | Sequence[ImageLike],
                 questions: QuestionsLike, base_dir: str | Path | None = None) -> None:
        qs = questions
        if type(qs) is not tuple or not all(type(q) is Question for q in qs):
            qs = questions_of(qs, f"item {id!r}")
        put = object.__setattr__  # frozen
        put(self, "id", id if type(id) is str else check_id(id, "item", "id"))
        put(self, "image", image if type(image) is str else item_media(image, f"item {id!r}"))
        put(self, "questions", qs)
        put(self, "base_dir", Path.cwd() if base_dir is None else Path(base_dir))

    @property
    def source(self) -> str:
        """How messages name the image: its path or URL as given, a table's ``FILE:ROW``, a
        shard's ``SHARD:MEMBER``, else ``image ID``."""
        if isinstance(self.image, (RowRef, MemberRef)):
            return self.image.source
        if isinstance(self.image, ImageList):
            return self.image.describe()
        if isinstance(self.image, VideoInput):
            v = self.image.source
            return v if isinstance(v, str) else f"video {self.id}"
        return self.image if isinstance(self.image, str) else f"image {self.id}"


def item_media(image: ImageLike | ImageList | VideoInput | Sequence[ImageLike],
               where: str) -> ItemMedia:
    """What an item keeps: a list of images as an ``ImageList`` of kept sources
    (``image_source``; ManifestError naming ``where`` when empty or over ``MAX_IMAGES``), an
    ``ImageList`` or ``VideoInput`` as given, one image as ``image_source`` keeps it."""
    if isinstance(image, ImageList) and image.per_image:  # vlmbatch.each_image's sources
        return dataclasses.replace(image, images=tuple(
            s if type(s) is str else image_source(s) for s in image.images))
    if isinstance(image, (ImageList, VideoInput)):
        return image
    if isinstance(image, Sequence) and not isinstance(image, (str, bytes)):
        try:
            check_images(image, where)
        except ValueError as e:
            raise ManifestError(str(e)) from None
        return ImageList(tuple(s if type(s) is str else image_source(s) for s in image))
    return image_source(image)


def image_source(image: ImageLike) -> ImageSource:
    """What an item holds for each kind of image a user may give: a ``Path`` as its text, a
    PIL image as its upright RGB pixels (uint8 ``[H, W, 3]``), a gray ``[H, W]`` or RGBA
    ``[H, W, 4]`` uint8 array as RGB; the other sources as they are. TypeError for anything
    else."""
    if isinstance(image, (str, bytes, RowRef, MemberRef, NotAnImage)):
        return image
    if isinstance(image, Path):
        return str(image)
    if isinstance(image, np.ndarray):
        if image.ndim == 2:
            return np.repeat(image[:, :, None], 3, axis=2)
        if image.ndim == 3 and image.shape[2] == 4:
            return np.ascontiguousarray(image[:, :, :3])
        return image
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only once its caller imported PIL
    if pil is not None and isinstance(image, pil.Image):
        turn = _UPRIGHT.get(image.getexif().get(0x0112, 1))  # EXIF orientation, as
        upright = image if turn is None else image.transpose(turn)  # ImageOps.exif_transpose
        return np.asarray(upright.convert("RGB"))
    raise TypeError(f"an image is a path, a URL, bytes, a PIL image or a uint8 array, not "
                    f"{type(image).__name__}")


def request_of(image: int, q: Question) -> Request:
    """The engine's request asking ``q`` about image ``image`` (an index into the images
    passed to ``Engine.score``)."""
    return Request(image, q.user_text, q.max_new_tokens, q.choices, q.system)


class ErrorKind(StrEnum):
    """Why an answer has none: its image could not be read (``source``), decoded
    (``decode``), was over the pixel limit (``too_large``), decoding hung (``decode_timeout``)
    or killed its worker (``decoder_crashed``), or the engine failed on its batch
    (``engine``); ``unknown`` only for failures recorded by versions that kept no kind."""
    SOURCE = "source"
    DECODE = "decode"
    TOO_LARGE = "too_large"
    DECODE_TIMEOUT = "decode_timeout"
    DECODER_CRASHED = "decoder_crashed"
    ENGINE = "engine"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ItemError:
    """Why an image has no answers (every question about it gets this)."""
    kind: ErrorKind
    message: str


# the fields of a part's line and of a parted item's line (``Answer``), in line order
PART_KEYS = ("part", "window", "image", "parts", "trigger", "trigger_window", "trigger_image")


@dataclass(frozen=True)
class Answer:
    """One (image, question) result. ``p_yes`` is rounded to 6 decimals and ``margin`` to 4,
    as every output shows them, so the API's answers equal ``vlmbatch run``'s lines.

    A label-set question (``choices`` set) has ``label`` (its most probable choice, also its
    ``answer``), ``probs`` (choice -> probability, the softmax of the log-likelihoods over the
    choices, in the choices' order) and ``logprobs`` (choice -> log-likelihood of its whole
    token sequence), both rounded to 6 decimals; its ``p_yes`` and ``margin`` are None."""
    image_id: str
    question_id: str
    question: str
    answer: str | None  # "yes" if p_yes >= the question's threshold, else "no"; None: error
    p_yes: float | None
    margin: float | None
    image_tokens: int | None
    text: str | None = None  # greedy text, where the question (or run) asked for one
    error: str | None = None
    error_kind: ErrorKind | None = None
    choices: tuple[str, ...] = ()  # the question's label set; (): a yes/no question
    label: str | None = None
    probs: dict[str, float] | None = None
    logprobs: dict[str, float] | None = None
    # what OpenAI's ``usage`` reports (not in ``line()``; kept by a job store): the prompt's
    # tokens, image ones included, and the answer's (1 for a yes/no); None: unknown
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # a clip's item: how many frames the model saw and each one's second in the clip (only
    # on video items' lines, so other lines stay as they were)
    frames: int | None = None
    seconds: tuple[float, ...] | None = None
    # an item asked part by part (windows of a clip, images each alone: pipeline/parts.py):
    # a part's line has ``part`` and its ``window`` or ``image``; the item's line ``parts``,
    # ``trigger`` (the part that gave its answer) and ``trigger_window`` or ``trigger_image``
    part: int | None = None
    window: tuple[float, float] | None = None
    image: int | None = None
    parts: int | None = None
    trigger: int | None = None
    trigger_window: tuple[float, float] | None = None
    trigger_image: int | None = None

    # the result line's fields, in order, with their types (CSV/Parquet columns); ``label``,
    # ``probs`` and ``logprobs`` appear in a JSONL line only for a label-set question (a CSV
    # or Parquet row holds the two maps as JSON text), ``text`` only when set
    COLUMNS: ClassVar[tuple[tuple[str, type], ...]] = (
        ("id", str), ("question_id", str), ("question", str), ("answer", str),
        ("p_yes", float), ("margin", float), ("image_tokens", int), ("error", str),
        ("error_kind", str), ("label", str), ("probs", str), ("logprobs", str), ("text", str))

    @classmethod
    def scored(cls, image_id: str, q: Question, s: Score) -> Answer:
        out = 1 if s.text is None else s.completion_tokens  # a yes/no or a label: one answer
        if not q.choices:
            return cls(image_id, q.id, q.text, "yes" if s.p_yes >= q.threshold else "no",
                       round(s.p_yes, 6), round(s.margin, 4), s.image_tokens, s.text,
                       prompt_tokens=s.prompt_tokens, completion_tokens=out)
        assert s.logprobs is not None and len(s.logprobs) == len(q.choices)
        lp = np.asarray(s.logprobs, dtype=np.float64)
        p = np.exp(lp - lp.max())
        p /= p.sum()
        label = q.choices[int(np.argmax(lp))]  # the first of equals, as argmax takes it
        return cls(image_id, q.id, q.text, label, None, None, s.image_tokens, s.text,
                   choices=q.choices, label=label,
                   probs={c: round(float(v), 6) for c, v in zip(q.choices, p)},
                   logprobs={c: round(float(v), 6) for c, v in zip(q.choices, lp)},
                   prompt_tokens=s.prompt_tokens, completion_tokens=out)

    @classmethod
    def failed(cls, image_id: str, q: Question, err: ItemError) -> Answer:
        return cls(image_id, q.id, q.text, None, None, None, None, None, err.message, err.kind,
                   choices=q.choices)

    def line(self) -> dict[str, Any]:
        """The result line: ``{"id", "question_id", "question", "answer", "p_yes", "margin",
        "image_tokens", "error", "error_kind"}``, then ``"label"``, ``"probs"`` and
        ``"logprobs"`` for a label-set question (null when failed), then ``"text"`` when
        set, then ``"frames"`` and ``"seconds"`` for a clip's item (``seen``), then the
        ``PART_KEYS`` that are set (an item asked part by part: ``pipeline/parts.py``)."""
        d: dict[str, Any] = {"id": self.image_id, "question_id": self.question_id,
                             "question": self.question, "answer": self.answer,
                             "p_yes": self.p_yes, "margin": self.margin,
                             "image_tokens": self.image_tokens, "error": self.error,
                             "error_kind": None if self.error_kind is None
                             else self.error_kind.value}
        if self.choices:
            d.update(label=self.label, probs=self.probs, logprobs=self.logprobs)
        if self.text is not None:
            d["text"] = self.text
        if self.frames is not None:
            d["frames"] = self.frames
            d["seconds"] = list(self.seconds or ())
        for key in PART_KEYS:
            if (v := getattr(self, key)) is not None:
                d[key] = list(v) if isinstance(v, tuple) else v
        return d

    def row(self) -> dict[str, Any]:
        """``line()`` as a flat row of ``COLUMNS`` (CSV, Parquet): the maps as JSON text,
        a field the line lacks as None."""
        d = self.line()
        for k in ("probs", "logprobs"):
            if d.get(k) is not None:
                d[k] = json.dumps(d[k], ensure_ascii=False)
        return {name: d.get(name) for name, _ in self.COLUMNS}

    def record(self) -> dict[str, Any]:
        """What a job store keeps: ``line()``, plus the label set (a failed label-set
        answer has no ``probs`` to read it from) and the token counts when known."""
        d = self.line()
        if self.choices:
            d["choices"] = list(self.choices)
        for name in ("prompt_tokens", "completion_tokens"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> Answer:
        """Inverse of ``record`` (also of a plain ``line``, and of the records of stores from
        before label sets and error kinds: a failure without a kind reads as ``unknown``)."""
        kind = d.get("error_kind")
        error_kind = ErrorKind(kind) if kind else (ErrorKind.UNKNOWN if d.get("error") else None)
        choices = tuple(d.get("choices") or d.get("probs") or ())
        a = cls(d["id"], d["question_id"], d["question"], d["answer"], d["p_yes"],
                d["margin"], d["image_tokens"], d.get("text"), d.get("error"), error_kind,
                choices, d.get("label"), d.get("probs"), d.get("logprobs"),
                d.get("prompt_tokens"), d.get("completion_tokens"), d.get("frames"),
                None if d.get("seconds") is None else tuple(d["seconds"]))
        part: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k in PART_KEYS
                                if (v := d.get(k)) is not None}
        return dataclasses.replace(a, **part) if part else a

    def seen(self, item: object) -> Answer:
        """This answer saying which frames the model saw, when ``item`` (the prepared item it
        was asked about) holds clips: their frames counted, their seconds in order (to the
        millisecond); as it is otherwise."""
        clips = [p for p in getattr(item, "parts", ()) if isinstance(p, PreparedVideo)]
        if not clips:
            return self
        seconds = tuple(round(s, 3) for v in clips for s in v.seconds)
        return dataclasses.replace(self, frames=len(seconds), seconds=seconds)


@dataclass(frozen=True)
class EmbedItem:
    """One embedding input: an image, a text, or both in one prompt. ``index``: its position
    in the input (what result lines carry); ``id``: a manifest's id, None for bare texts."""
    index: int
    id: str | None
    image: ImageSource | None
    text: str | None
    base_dir: Path  # relative image paths resolve against this

    def __post_init__(self) -> None:
        if self.image is None and not self.text:
            raise ValueError(f"embedding input {self.index}: give an image, a text or both")

    @property
    def source(self) -> str:
        """How messages name the input's image: its path or URL, else ``image INDEX``."""
        return self.image if isinstance(self.image, str) else f"image {self.id or self.index}"

    @property
    def key(self) -> str:
        """Its id, else its index: unique within a run (what a job store keys it by)."""
        return self.id if self.id is not None else str(self.index)


@dataclass(frozen=True, eq=False)
class Embedding:
    """One embedding result (an item's vector, or why it has none): what every output of
    ``vlmbatch embed`` and an embedding job is derived from."""
    index: int
    id: str | None
    tokens: int | None
    vector: np.ndarray | None  # float32 [D] or [T, D]; None: error
    error: str | None = None
    error_kind: ErrorKind | None = None

    @classmethod
    def of(cls, item: EmbedItem, v: Vector) -> Embedding:
        return cls(item.index, item.id, v.tokens, v.values)

    @classmethod
    def failed(cls, item: EmbedItem, err: ItemError) -> Embedding:
        return cls(item.index, item.id, None, None, err.message, err.kind)

    def line(self) -> dict[str, Any]:
        """``{"index", "id" (when given), "tokens", "embedding"}``, then ``"error"`` when
        failed; floats in float32's shortest form (they read back bit for bit)."""
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
        d["tokens"] = self.tokens
        d["embedding"] = None if self.vector is None else _floats(self.vector)
        if self.error is not None:
            d["error"] = self.error
        return d

    def record(self) -> dict[str, Any]:
        """What a job store keeps: the vector as base64 little-endian float32 with its shape
        (a quarter of JSON floats' size), ``error`` (null when embedded) and its kind."""
        v = self.vector
        return {"index": self.index, "id": self.id, "tokens": self.tokens,
                "shape": None if v is None else list(v.shape),
                "vector": None if v is None else base64.b64encode(
                    v.astype("<f4").tobytes()).decode(),
                "error": self.error,
                "error_kind": None if self.error_kind is None else self.error_kind.value}

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> Embedding:
        """Inverse of ``record``."""
        v = None if d["vector"] is None else np.frombuffer(
            base64.b64decode(d["vector"]), "<f4").astype(np.float32).reshape(d["shape"])
        kind = d.get("error_kind")
        return cls(d["index"], d["id"], d["tokens"], v, d.get("error"),
                   ErrorKind(kind) if kind else None)


def _floats(v: np.ndarray) -> list:
    """float32 values as Python floats printed in float32's shortest decimal form (nested
    lists for a multi-vector)."""
    if v.ndim > 1:
        return [_floats(row) for row in v]
    return [float(str(x)) for x in v.astype(np.float32)]
