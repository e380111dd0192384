"""The Python API: ``vlmbatch.VLM``, the same engine, defaults and errors as the CLI.

    import vlmbatch
    vlm = vlmbatch.VLM()                      # the built-in model
    vlm = vlmbatch.VLM("DIR", device="cuda", dtype="bfloat16", prefix_cache=False)
    for a in vlm.ask(["a.jpg", pil_image, rgb_array, jpeg_bytes],
                     ["Is there a red shape?", {"id": "c", "text": "Is there a circle?",
                                                "threshold": 0.7}]):
        print(a.image_id, a.question_id, a.answer, a.p_yes)
    vlm.ask_many([vlmbatch.ImageItem("s2", "b.jpg", ["Is there a red shape?"]),
                  ("s3", pil_image, [{"id": "c", "text": "A circle?", "threshold": 0.7}]),
                  (jpeg_bytes, ["Red?"])])  # a stream of Answers, with your ids (or places)

    emb = vlmbatch.VLM(vlmbatch.EMBED_MODEL)  # the built-in embedding model
    vecs = emb.embed(texts=["a red circle"], images=["a.jpg"])  # [2, D] float32, unit rows
    for e in emb.embed_many([("a.jpg", "a caption"), "a text", ("b.png", None)]):
        e.vector, e.tokens, e.error                  # one Embedding per input
    vlmbatch.maxsim(q_vectors, d_vectors)            # multi-vector late-interaction scores

Images are paths (relative to the current folder), ``file://`` or ``data:`` URLs, encoded
bytes, PIL images or uint8 RGB arrays ``[H, W, 3]`` (gray ``[H, W]`` and RGBA ``[H, W, 4]``
are converted as Pillow's ``convert("RGB")`` would). Where an image goes, a list of images
is one prompt holding them in order, and ``vlmbatch.video("clip.mp4", fps=2)`` a clip::

    vlm.ask([["front.jpg", "back.jpg"], vlmbatch.video("clip.mkv", num_frames=8)],
            ["Red?"]) Questions are strings or objects as in
a manifest (``id``, ``text``, ``threshold``, ``max_new_tokens``, ``choices``, ``prompt``,
``system``); a malformed one raises ``ManifestError`` before any work. A label-set question
(``choices``) gives ``Answer``s with ``label``, ``probs`` and ``logprobs``::

    a, = vlm.ask("a.jpg", [{"id": "colour", "text": "What color is the shape?",
                            "choices": ["red", "green", "blue"]}])
    a.label, a.probs["red"], a.logprobs["red"]

A bad image is never an exception: its answers carry ``error`` and ``error_kind``, as
``vlmbatch run``'s lines do, and the rest go on.

Both calls stream: images are taken ``images_per_batch`` at a time, prepared in decoder
processes while the model answers the previous batch (each image under ``decode_timeout``
seconds: a decoder that hangs or crashes is that image's ``decode_timeout`` /
``decoder_crashed`` error), and answered with the image-aware prefix cache, through the same
drive loop as ``vlmbatch run`` (``pipeline/drive.py``); memory stays bounded whatever the
number of items. Answers come in item then question order. The decoder processes start with
the first image and live as long as the ``VLM`` (``close()``, or ``with vlmbatch.VLM() as
vlm:``, ends them; so does the interpreter's exit).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import EMBED_GROUP, EmbedConfig, EngineConfig, ModelConfig, default_of
from vlmbatch.engine.embed import EmbedHandle, build_embedder
from vlmbatch.engine.loading import text_tokens
from vlmbatch.jobs.config import RunConfig
from vlmbatch.pipeline.config import PrepareConfig
from vlmbatch.pipeline.drive import drive, groups_of
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.pipeline.media_inputs import VideoInput
from vlmbatch.pipeline.preparers import PrepareWorkers, preparer
from vlmbatch.pipeline.questions import MAX_PROMPT_CHARS, PromptLimits, Question, questions_of
from vlmbatch.pipeline.records import (
    Answer,
    Embedding,
    EmbedItem,
    ImageItem,
    image_source,
    item_media,
)
from vlmbatch.pipeline.task import AnswerTask, EmbedTask, Task
from vlmbatch.preprocessing.sources import NotAnImage

ImageLike = str | Path | bytes | np.ndarray | Image.Image
# an item's visual input beyond one image: several in one prompt, or a clip
MediaLike = list[ImageLike] | tuple[ImageLike, ...] | VideoInput
QuestionLike = str | dict | Question
# an item of ask_many: an ImageItem, (id, image, questions), or (image, questions)
ItemLike = (ImageItem | tuple[str | int, ImageLike | MediaLike,
                              Sequence[QuestionLike] | QuestionLike]
            | tuple[ImageLike | MediaLike, Sequence[QuestionLike] | QuestionLike])
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"path", "device", "dtype"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
# an embedding input: a text (str), an image (not a str), (image, text) in one prompt
EmbedLike = str | Path | bytes | np.ndarray | Image.Image | tuple[ImageLike | None,
                                                                 str | None] | EmbedItem


class VLM:
    """A loaded model and engine; ``options`` are ``ModelConfig``/``EngineConfig`` fields
    (``tiling``, ``max_tiles``, ``prefix_cache``, ``max_new_tokens``, ``vit_backend``, ...,
    with the CLI's defaults). ``decode_timeout``: seconds an image may take to read and
    decode (0: decode on threads of this process, no deadline). ``max_prompt_chars``: the
    longest question (text, prompt and system; ``--max-prompt-chars``); a longer one, or one
    longer than the model's context in tokens, raises ``ManifestError`` (a ValueError)
    naming it, before any work. ``max_video_seconds`` (``--max-video-seconds``): a longer
    clip is its answers' error; ``max_video_tokens`` (``--max-video-tokens``): each clip's
    visual token budget where its own ``vlmbatch.video(..., max_video_tokens=)`` gives none.
    ``hooks``: fault injection for tests."""

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu",
                 dtype: str = "auto", images_per_batch: int | None = None,
                 max_pixels: int | None = None, threads: int | None = None,
                 preprocess_threads: int | None = None, decode_timeout: float | None = None,
                 max_prompt_chars: int = MAX_PROMPT_CHARS, hooks: FaultHooks = NO_HOOKS,
                 max_video_seconds: float | None = None, max_video_tokens: int | None = None,
                 **options: Any) -> None:
        unknown = sorted(set(options) - _MODEL_FIELDS - _ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"unknown VLM option(s) {unknown}; model options: "
                            f"{sorted(_MODEL_FIELDS)}, engine options: {sorted(_ENGINE_FIELDS)}")
        self.model_config = ModelConfig(Path(model) if model is not None else None, device,
                                        dtype, **{k: v for k, v in options.items()
                                                  if k in _MODEL_FIELDS})
        self.engine_config = EngineConfig(**{k: v for k, v in options.items()
                                             if k in _ENGINE_FIELDS})
        self.images_per_batch = images_per_batch or default_of(RunConfig, "images_per_batch")
        self.embed_batch = images_per_batch or EMBED_GROUP  # inputs per embedder call
        p = PrepareConfig()
        self.prepare = PrepareConfig(  # checked as the CLI's
            max_pixels or p.max_pixels, preprocess_threads,
            p.decode_timeout if decode_timeout is None else decode_timeout,
            max_video_tokens=max_video_tokens,
            max_video_seconds=p.max_video_seconds if max_video_seconds is None
            else max_video_seconds).options(device)
        self.hooks = hooks
        count, context = text_tokens(self.model_config.path)
        self.limits = PromptLimits(max_prompt_chars, context, count)
        self.engine = build_engine(self.model_config, self.engine_config, threads)
        self._embedders: dict[EmbedConfig, EmbedHandle] = {}
        self._workers: PrepareWorkers | None = None
        self._finalizer: weakref.finalize | None = None

    def ask(self, images: ImageLike | VideoInput | Sequence[ImageLike | MediaLike],
            questions: Sequence[QuestionLike]) -> Iterator[Answer]:
        """Every question about every image; image ids are their positions ("0", "1", ...).
        An entry may be a list of images (one item: one prompt holding them in order) or a
        clip (``vlmbatch.video(path, fps=...)``), whose answers say which frames the model
        saw (``Answer.frames``, ``seconds``); a clip in windows (``segment_seconds=``) or
        ``vlmbatch.each_image([...])`` gets a part's answers, then the item's
        (``pipeline/parts.py``)."""
        if isinstance(images, (str, Path, bytes, np.ndarray, Image.Image, VideoInput)) \
                or not isinstance(images, Iterable):
            images = [images]
        qs = questions_of(questions)
        for i, q in enumerate(qs):  # a label set the engine cannot score, a question over
            self.limits.check(q, f"questions[{i}]")  # the limits: here, before any work
            if q.choices:
                self.engine.check_choices(q.choices)
        return self.ask_many(_image_item(str(i), im, qs) for i, im in enumerate(images))

    def ask_many(self, items: Iterable[ItemLike]) -> Iterator[Answer]:
        """Answers for a stream of items, each an ``ImageItem`` (``ImageItem(id, image,
        questions)``: what ``ask`` takes, and your id), an ``(id, image, questions)`` triple
        (the same), or an ``(image, questions)`` pair (its id its position in the stream).
        Answers carry the items' ids; items may repeat an id (each is answered about its own
        image). A label set the engine cannot score as configured raises ``ChoiceError``
        when the stream reaches its item, before that item's group is answered."""
        groups = groups_of(self._checked(_item(i, x) for i, x in enumerate(items)),
                           self.images_per_batch)
        renamed: dict[str, str] = {}  # a repeated id's key in its group -> the id
        for done, results in self._done(AnswerTask(), (_distinct(g, renamed) for g in groups)):
            for it, answers in zip(done, results):
                if (given := renamed.pop(it.id, None)) is not None:
                    answers = [dataclasses.replace(a, image_id=given) for a in answers]
                yield from answers

    def _checked(self, items: Iterable[ImageItem]) -> Iterator[ImageItem]:
        """``items``, each label set checked against the engine (``Engine.check_choices``),
        each question's length against the limits."""
        for it in items:
            for q in it.questions:
                self.limits.check(q, f"item {it.id!r}")
                if q.choices:
                    self.engine.check_choices(q.choices)
            yield it

    def embed(self, texts: Sequence[str] = (), images: Sequence[ImageLike] = (),
              **options: Any) -> np.ndarray:
        """Unit vectors ``[len(texts) + len(images), D]`` float32: the texts' rows first,
        then the images' (each image alone, with the family's image prompt). ``options``:
        ``EmbedConfig`` fields (``pooling``, ``dimensions``, ``force_dimensions``,
        ``prompt``, ``query_prefix``, ``document_prefix``). Raises ValueError naming the
        input if one cannot be embedded (an unreadable image): use ``embed_many`` to get
        per-input errors instead. For one vector per token: ``embed_many(...,
        multi_vector=True)``."""
        if isinstance(texts, str) or isinstance(images, (str, Path, bytes, np.ndarray,
                                                         Image.Image)):
            raise TypeError("embed takes sequences: texts=[...], images=[...]")
        if self.embedder(EmbedConfig(**options)).resolved.multi_vector:
            raise ValueError("embed returns one vector per input; use embed_many for "
                             "multi-vector embeddings (a ColQwen2 checkpoint gives them "
                             "unless multi_vector=False or a pooling is asked for)")
        inputs: list[EmbedLike] = [*texts, *((im, None) for im in images)]
        out = list(self.embed_many(inputs, **options))
        bad = [e for e in out if e.vector is None]
        if bad:
            raise ValueError(f"input {bad[0].index} could not be embedded: {bad[0].error}")
        vectors = [e.vector for e in out if e.vector is not None]
        return np.stack(vectors) if vectors else np.zeros((0, 0), np.float32)

    def embed_many(self, inputs: Iterable[EmbedLike], **options: Any) -> Iterator[Embedding]:
        """One ``Embedding`` per input, in order (``vector``, ``tokens``: the prompt's token
        count, as an OpenAI ``usage`` counts it; ``error`` for an input that could not be
        embedded, which never raises). An input is a text (a ``str`` is always a text), an
        image (a ``Path``, bytes, a PIL image or an array; a path or URL as a string:
        ``(image, None)``), ``(image, text)`` for both in one prompt, or an ``EmbedItem``.
        Streamed and batched as ``vlmbatch embed`` does it, over the same engine (and prefix
        cache) as ``ask``."""
        cfg = self.embedder(EmbedConfig(**options)).cfg  # checked before any work
        groups = groups_of((_embed_item(i, x) for i, x in enumerate(inputs)), self.embed_batch)
        yield from self._results(EmbedTask(cfg), groups)

    def embedder(self, cfg: EmbedConfig) -> EmbedHandle:
        """The embedder for ``cfg`` on this VLM's engine (built once per config). ``VLM()``
        (the built-in yes/no model) refuses, naming the built-in embedding model that
        ``vlmbatch embed`` uses by default."""
        if self.model_config.path is None:
            raise ValueError("VLM() is the built-in yes/no model, not trained for "
                             "embeddings; `vlmbatch embed` uses the built-in embedding model: "
                             "vlmbatch.VLM(vlmbatch.EMBED_MODEL).embed(...)")
        if cfg not in self._embedders:
            self._embedders[cfg] = build_embedder(self.engine, cfg)
        return self._embedders[cfg]

    def _results(self, task: Task, groups: Iterable[list]) -> Iterator[Any]:
        """Each group's results through the drive loop, flattened, on this VLM's workers."""
        for _, results in self._done(task, groups):
            for per_item in results:
                yield from per_item

    def _done(self, task: Task, groups: Iterable[list]) -> Iterator[tuple[list, list]]:
        """(a group's items, each item's results) through the drive loop, on this VLM's
        workers."""
        yield from drive(task, self.engine, groups, self.prepare, hooks=self.hooks,
                         workers=self._prepare_workers())

    def _prepare_workers(self) -> PrepareWorkers | None:
        """The decoder processes (or threads) every call shares, made once."""
        if self._workers is None:
            self._workers = preparer(self.engine.image_plan, self.prepare, self.hooks)
            if self._workers is not None:
                self._finalizer = weakref.finalize(self, self._workers.stop)
        return self._workers

    def close(self) -> None:
        """Stop the decoder processes (a later call starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
        self._workers = self._finalizer = None

    def __enter__(self) -> VLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _item(i: int, x: ItemLike) -> ImageItem:
    if isinstance(x, ImageItem):
        return x
    if not isinstance(x, tuple) or len(x) not in (2, 3):
        raise TypeError(f"item {i}: an ImageItem, (id, image, questions) or (image, "
                        f"questions), not {type(x).__name__}")
    item_id, image, questions = x if len(x) == 3 else (str(i), *x)
    return _image_item(item_id, image, questions)


def _image_item(item_id: str | int, image: object, questions: Any) -> ImageItem:
    """An item of ``image``; one that is no kind of image (``None``, ``42``) is the item's
    ``source`` error when it is read, as a bad file is, not an exception for the call."""
    try:
        source = item_media(image, f"item {item_id!r}")  # type: ignore[arg-type]
    except TypeError as e:
        source = NotAnImage(str(e))
    return ImageItem(item_id, source, questions)


def _distinct(group: list[ImageItem], renamed: dict[str, str]) -> list[ImageItem]:
    """``group`` with a repeated id keyed apart (``ID#K``, K its place in the group, noted in
    ``renamed``): the drive tells a group's items apart by id."""
    ids = {it.id for it in group}
    if len(ids) == len(group):
        return group
    seen: set[str] = set()
    out = []
    for k, it in enumerate(group):
        if it.id in seen:
            key = next(c for n in range(k, k + len(group) + 1)
                       if (c := f"{it.id}#{n}") not in ids and c not in renamed)
            renamed[key] = it.id
            it = dataclasses.replace(it, id=key)
        seen.add(it.id)
        out.append(it)
    return out


def _embed_item(i: int, x: EmbedLike) -> EmbedItem:
    if isinstance(x, EmbedItem):
        return x
    if isinstance(x, tuple):
        image, text = x
        return EmbedItem(i, None, None if image is None else image_source(image), text,
                         Path.cwd())
    if isinstance(x, str):
        return EmbedItem(i, None, None, x, Path.cwd())
    return EmbedItem(i, None, image_source(x), None, Path.cwd())
