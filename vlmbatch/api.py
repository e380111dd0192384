"""The Python API: ``vlmbatch.VLM``, the same engine, defaults and errors as the CLI.

    import vlmbatch
    vlm = vlmbatch.VLM()                      # the built-in model
    vlm = vlmbatch.VLM("DIR", device="cuda", dtype="bfloat16", prefix_cache=False)
    for a in vlm.ask(["a.jpg", pil_image, rgb_array, jpeg_bytes],
                     ["Is there a red shape?", {"id": "c", "text": "Is there a circle?",
                                                "threshold": 0.7}]):
        print(a.image_id, a.question_id, a.answer, a.p_yes)
    vlm.ask_many(items)    # (image, questions) pairs or ImageItems: a stream of Answers

Images are paths (relative to the current folder), ``file://`` or ``data:`` URLs, encoded
bytes, PIL images or uint8 RGB arrays ``[H, W, 3]`` (gray ``[H, W]`` and RGBA ``[H, W, 4]``
are converted as Pillow's ``convert("RGB")`` would). Questions are strings or objects as in
a manifest (``id``, ``text``, ``threshold``, ``max_new_tokens``); a malformed one raises
``ManifestError`` before any work. A bad image is never an exception: its answers carry
``error`` and ``error_kind``, as ``vlmbatch run``'s lines do, and the rest go on.

Both calls stream: images are taken ``images_per_batch`` at a time, prepared on
preprocessing threads while the model answers the previous batch, and answered with the
image-aware prefix cache, exactly as ``vlmbatch run`` does (``pipeline/drive.py``); memory
stays bounded whatever the number of items. Answers come in item then question order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from jobs.config import RunConfig
from jobs.manifest import parse_question
from pipeline.build import build_engine
from pipeline.config import EngineConfig, ModelConfig, default_of, preprocess_threads_for
from pipeline.drive import prepared_groups, score_group
from pipeline.records import Answer, ImageItem, Question

ImageLike = str | Path | bytes | np.ndarray | Image.Image
QuestionLike = str | dict | Question
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"path", "device", "dtype"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class VLM:
    """A loaded model and engine; ``options`` are ``ModelConfig``/``EngineConfig`` fields
    (``tiling``, ``max_tiles``, ``prefix_cache``, ``max_new_tokens``, ``vit_backend``, ...,
    with the CLI's defaults)."""

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu",
                 dtype: str = "float32", images_per_batch: int | None = None,
                 max_pixels: int | None = None, threads: int | None = None,
                 preprocess_threads: int | None = None, **options: Any) -> None:
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
        self.max_pixels = max_pixels or default_of(RunConfig, "max_pixels")
        self.preprocess_threads = preprocess_threads_for(preprocess_threads, device)
        if threads:
            torch.set_num_threads(threads)
        self.engine = build_engine(self.model_config, self.engine_config)

    def ask(self, images: ImageLike | Sequence[ImageLike],
            questions: Sequence[QuestionLike]) -> Iterator[Answer]:
        """Every question about every image; image ids are their positions ("0", "1", ...)."""
        if isinstance(images, (str, Path, bytes, np.ndarray, Image.Image)):
            images = [images]
        qs = questions_of(questions)
        return self.ask_many(ImageItem(str(i), image_source(im), qs, Path.cwd())
                             for i, im in enumerate(images))

    def ask_many(self, items: Iterable[ImageItem | tuple[ImageLike, Sequence[QuestionLike]]]
                 ) -> Iterator[Answer]:
        """Answers for a stream of items: ``ImageItem``s, or ``(image, questions)`` pairs
        (ids are their positions in the stream)."""
        groups = _groups((_item(i, x) for i, x in enumerate(items)), self.images_per_batch)
        with closing(prepared_groups(groups, self.engine.image_plan, self.max_pixels,
                                     self.preprocess_threads)) as prepared:
            for pg in prepared:
                yield from score_group(self.engine, pg)


def questions_of(questions: Sequence[QuestionLike]) -> tuple[Question, ...]:
    """Questions as a manifest line would give them (ids q0, q1, ... unless set)."""
    if isinstance(questions, (str, dict, Question)):
        questions = [questions]
    out = tuple(q if isinstance(q, Question) else parse_question(q, "questions", i)
                for i, q in enumerate(questions))
    if not out:
        raise ValueError("no questions to ask")
    return out


def image_source(image: ImageLike) -> str | bytes | np.ndarray:
    """What an ``ImageItem`` holds for each kind of image the API takes."""
    if isinstance(image, Path):
        return str(image)
    if isinstance(image, Image.Image):
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    if isinstance(image, np.ndarray):
        if image.ndim == 2:
            return np.repeat(image[:, :, None], 3, axis=2)
        if image.ndim == 3 and image.shape[2] == 4:
            return np.ascontiguousarray(image[:, :, :3])
    return image


def _item(i: int, x: ImageItem | tuple[ImageLike, Sequence[QuestionLike]]) -> ImageItem:
    if isinstance(x, ImageItem):
        return x
    image, questions = x
    return ImageItem(str(i), image_source(image), questions_of(questions), Path.cwd())


def _groups(items: Iterable[ImageItem], n: int) -> Iterator[list[ImageItem]]:
    group: list[ImageItem] = []
    for it in items:
        group.append(it)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group
