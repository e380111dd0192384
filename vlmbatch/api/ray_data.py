"""Ray Data stages: callable classes for ``Dataset.map_batches``, one model per actor.

    import ray
    from vlmbatch.api.ray_data import Answerer, Preparer
    ds = ray.data.read_parquet("images.parquet")             # or read_images, read_webdataset
    out = ds.map_batches(Answerer, fn_constructor_kwargs={"policy": "policy.yaml",
                         "id_column": "id"}, compute=ray.data.ActorPoolStrategy(size=2),
                         batch_size=16, num_gpus=0)           # 1 with device="cuda"
    # or: preparation on CPU actors first (as Ray Data LLM separates its stages)
    ds.map_batches(Preparer, fn_constructor_kwargs={"id_column": "id"}, compute=...) \\
      .map_batches(Answerer, fn_constructor_kwargs={"policy": ..., "prepared": True}, ...)

``Answerer`` loads a ``VLM`` (``api/vlm.py``) once per actor and answers through the same
drive loop as ``VLM.ask_many`` (decoder processes under ``decode_timeout``, the image-aware
prefix cache), so its rows are ``vlmbatch run``'s lines (tested): one row per (image,
question), in row then question order, with ``Answer.COLUMNS`` (``Answer.row``: ``id``,
``question_id``, ``question``, ``answer``, ``p_yes``, ``margin``, ``image_tokens``,
``error``, ``error_kind``, ``label``, ``probs`` and ``logprobs`` as JSON text, ``text``),
then ``frames`` and ``seconds`` (a clip's rows; null on others), returned as a
``pyarrow.Table`` of that fixed schema, so every batch has the same types whatever is null
in it. A row may hold a list of images (``images``) or a clip (``video``, sampled by its
``fps``/``num_frames``/``max_frames`` columns) instead of an image: ``api/ray_columns.py``.
Other input columns are not carried (a row per question would repeat them): join on ``id``.

Invariants:
- A bad image (undecodable, unreadable, a null or unsupported cell, over ``max_pixels``)
  gives its rows ``error``/``error_kind`` and never raises; the other rows go on. Only a
  misconfiguration raises (no questions, a malformed questions cell, a label set the model
  cannot score, prepared images from another image plan), so Ray fails the dataset loudly.
- An image cell is encoded bytes, a path or URL (relative paths against ``base_dir``), an
  ``[H, W, 3]`` uint8 array (``read_images``; gray and RGBA converted) or an HF ``{"bytes",
  "path"}`` struct. A row's id is its ``id_column`` value, else its position in the batch
  (not unique across batches: give an id column, e.g. ``read_images(include_paths=True)``
  and ``id_column="path"``).
- ``Preparer`` needs no weights: the image plan comes from the checkpoint's config, with the
  same model options as the ``Answerer``'s. Its ``prepared`` column is a pickled
  ``(plan, PreparedImage)`` (uint8 rows, grid, content hash): for the next stage, not for
  storage; an ``Answerer(prepared=True)`` whose engine has another image plan refuses it.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vlmbatch.api.ray_columns import answer_table, media_cells
from vlmbatch.api.vlm import VLM, QuestionLike
from vlmbatch.engine.config import EmbedConfig, ModelConfig
from vlmbatch.engine.loading import image_plan_for, read_spec, video_plan_for
from vlmbatch.engine.records import Item
from vlmbatch.inputs.datasets import own_questions
from vlmbatch.inputs.manifest import policy_questions, read_policy, with_policy
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL
from vlmbatch.pipeline.config import PrepareConfig
from vlmbatch.pipeline.drive import prepared_groups, run_group
from vlmbatch.pipeline.preparers import preparer
from vlmbatch.pipeline.questions import check_id, questions_of
from vlmbatch.pipeline.records import (
    Answer,
    EmbedItem,
    ErrorKind,
    ImageItem,
    ItemError,
    image_source,
)
from vlmbatch.pipeline.task import AnswerTask, Prepared

PREPARED, PREPARE_ERROR, PREPARE_ERROR_KIND = "prepared", "prepare_error", "prepare_error_kind"
Batch = Mapping[str, Any]  # a dict of numpy arrays (batch_format="numpy") or a DataFrame


def _pa() -> Any:
    import pyarrow  # optional dependency (Ray Data brings it): only a Ray stage needs it
    return pyarrow


def columns(batch: Batch) -> dict[str, list]:
    """A numpy or pandas batch as plain column lists (numpy scalars as Python values)."""
    return {str(k): [v.item() if isinstance(v, np.generic) else v for v in batch[k]]
            for k in batch.keys()}


def image_cell(value: object) -> str | bytes | np.ndarray | ItemError:
    """An image column's cell as an ``ImageItem`` image, or why it is none (module
    docstring)."""
    if isinstance(value, Mapping):  # HF datasets' Image feature: {"bytes", "path"}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and value:
        return value
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and (
            value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (3, 4))):
        return image_source(value)  # type: ignore[return-value]
    what = "null" if value is None else (
        f"array {value.dtype} {value.shape}" if isinstance(value, np.ndarray)
        else type(value).__name__)
    return ItemError(ErrorKind.SOURCE, f"no image in the cell: {what} (need encoded bytes, a "
                                       "path/URL or uint8 [H, W, 3] pixels)")


def row_ids(cols: dict[str, list], n: int, id_column: str | None) -> list[str]:
    """Each row's id: its ``id_column`` value (checked as a manifest's), else its position."""
    if id_column is None:
        return [str(i) for i in range(n)]
    if id_column not in cols:
        raise KeyError(f"id column {id_column!r} not in the batch (columns: {sorted(cols)})")
    return [check_id(v, f"row {i}", id_column) for i, v in enumerate(cols[id_column])]


def unique_keys(ids: list[str]) -> list[str]:
    """Keys the drive loop can tell apart: the ids, a repeat suffixed with its position."""
    seen: set[str] = set()
    out = []
    for i, x in enumerate(ids):
        out.append(x if x not in seen else f"{x}#{i}")
        seen.add(x)
    return out


class Answerer:
    """``map_batches(Answerer, fn_constructor_kwargs={...})``: a batch in, its answer rows out
    (module docstring). ``policy``: a policy file (.yaml/.toml) or its parsed dict;
    ``questions``: questions as ``VLM.ask`` takes them; ``questions_column``: each row's own
    questions (a string, a list, or JSON text), asked before the policy's. ``prepared``: the
    batch comes from a ``Preparer``. ``vlm_options``: ``VLM``'s (``device``, ``dtype``,
    ``images_per_batch``, ``decode_timeout``, ``max_tiles``, ...). ``images_column`` (a list
    of images per row) and ``video_column`` (a clip per row, sampled by the row's ``fps``,
    ``num_frames``, ``max_frames`` columns): ``api/ray_columns.py``."""

    def __init__(self, model: str | Path | None = None, *,  # noqa: PLR0913
                 policy: str | Path | dict | None = None,
                 questions: Sequence[QuestionLike] | None = None, image_column: str = "image",
                 id_column: str | None = None, questions_column: str | None = None,
                 prepared: bool = False, base_dir: str | Path | None = None,
                 images_column: str = "images", video_column: str = "video",
                 **vlm_options: Any) -> None:
        self.policy = (policy_questions(policy, "policy") if isinstance(policy, dict)
                       else read_policy(Path(policy)) if policy is not None else ())
        self.policy += questions_of(questions) if questions else ()
        if not self.policy and questions_column is None:
            raise ValueError("no questions: give policy=, questions= or questions_column=")
        self.image_column, self.id_column = image_column, id_column
        self.media_columns = (image_column, images_column, video_column)
        self.questions_column, self.prepared = questions_column, prepared
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
        self.vlm = VLM(model, **vlm_options)
        self._check(self.policy)
        self.plan = repr(self.vlm.engine.image_plan)

    def _check(self, qs: Iterable[Any]) -> None:
        for q in qs:  # a label set the engine cannot score: a misconfiguration, raised
            if q.choices:
                self.vlm.engine.check_choices(q.choices)

    def __call__(self, batch: Batch) -> Any:
        cols = columns(batch)
        n = len(next(iter(cols.values()), []))
        ids = row_ids(cols, n, "id" if self.prepared else self.id_column)
        keys = unique_keys(ids)
        own = cols.get(self.questions_column, [None] * n) if self.questions_column else [None] * n
        qs = [with_policy(own_questions(q, f"row {ids[i]}"), self.policy, f"row {ids[i]}",
                          "give --policy or questions_column=") for i, q in enumerate(own)]
        self._check({q for row in qs for q in row})
        per_row = self._answers(cols, keys, qs, ids) if not self.prepared \
            else self._answers_prepared(cols, keys, qs)
        return answer_table([dataclasses.replace(a, image_id=i) if a.image_id != i else a
                             for i, answers in zip(ids, per_row) for a in answers])

    def _answers(self, cols: dict[str, list], keys: list[str], qs: list[tuple],
                 ids: list[str]) -> list[list[Answer]]:
        """Each row's answers through ``VLM.ask_many``; a bad cell's without the model."""
        cells = media_cells(cols, len(keys), self.media_columns, ids, image_cell)
        good = (ImageItem(k, c, q, self.base_dir) for k, c, q in zip(keys, cells, qs)
                if not isinstance(c, ItemError))
        stream = self.vlm.ask_many(good)  # in item then question order
        out: list[list[Answer]] = []
        for k, c, q in zip(keys, cells, qs):
            item = ImageItem(k, "", q, self.base_dir)
            out.append(AnswerTask().failed(item, c) if isinstance(c, ItemError)
                       else [next(stream) for _ in q])
        return out

    def _answers_prepared(self, cols: dict[str, list], keys: list[str], qs: list[tuple]
                          ) -> list[list[Answer]]:
        """Rows from a ``Preparer``: stage 2 only, ``images_per_batch`` images at a time."""
        rows = list(zip(keys, qs, cols[PREPARED], cols[PREPARE_ERROR], cols[PREPARE_ERROR_KIND]))
        out: list[list[Answer]] = []
        n = self.vlm.images_per_batch
        for group in (rows[s: s + n] for s in range(0, len(rows), n)):
            items = [ImageItem(k, k, q, self.base_dir) for k, q, *_ in group]
            images: list[Item | None] = []
            errors: dict[str, ItemError] = {}
            for k, _, blob, err, kind in group:
                if blob is None:
                    images.append(None)
                    errors[k] = ItemError(ErrorKind(kind or "unknown"), err or "not prepared")
                    continue
                plan, image = pickle.loads(blob)  # noqa: S301  (our own previous stage)
                if plan != self.plan:
                    raise ValueError(f"row {k} was prepared for the image plan {plan}, this "
                                     f"model's is {self.plan}: give both stages the same "
                                     "model options")
                images.append(image)
            out += run_group(AnswerTask(), self.vlm.engine, Prepared(items, images, errors))
        return out

    def __del__(self) -> None:
        vlm = getattr(self, "vlm", None)
        if vlm is not None:  # the actor's decoder processes (they die with it anyway)
            vlm.close()


class Preparer:
    """``map_batches(Preparer, ...)`` on CPU actors: each row's image read, decoded and
    prepared for the model's image plan (no weights loaded), in decoder processes under
    ``decode_timeout`` as the one-stage form does. Out: ``id``, ``prepared`` (binary, null
    when failed), ``prepare_error``, ``prepare_error_kind``, and the ``carry`` columns as they
    came. A list or a clip (``api/ray_columns.py``) is prepared into its ``MediaItem``, the
    clip sampled by the checkpoint's video processor and the row's sampling columns.
    ``options``: ``ModelConfig`` image options (``tiling``, ``max_tiles``,
    ``upscale_limit``, ``max_image_tokens``): the ``Answerer``'s."""

    def __init__(self, model: str | Path | None = None, *,  # noqa: PLR0913
                 image_column: str = "image", id_column: str | None = None,
                 carry: Sequence[str] = (), base_dir: str | Path | None = None,
                 max_pixels: int | None = None, decode_timeout: float | None = None,
                 preprocess_threads: int | None = None, images_column: str = "images",
                 video_column: str = "video", **options: Any) -> None:
        cfg = ModelConfig(Path(model) if model is not None else None, **options)
        family, spec = read_spec(cfg.path)
        self.plan = image_plan_for(family, spec, cfg)
        # clips sampled by the checkpoint's video processor, as the Answerer's engine samples
        self.task = AnswerTask(video_plan_for(spec))
        self.media_columns = (image_column, images_column, video_column)
        self.key = repr(self.plan)
        p = PrepareConfig()
        self.opts = PrepareConfig(max_pixels or p.max_pixels, preprocess_threads,
                                  p.decode_timeout if decode_timeout is None
                                  else decode_timeout).options("cpu")
        self.workers = preparer(self.plan, self.opts)
        self.image_column, self.id_column, self.carry = image_column, id_column, tuple(carry)
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()

    def __call__(self, batch: Batch) -> Any:
        cols = columns(batch)
        n = len(next(iter(cols.values()), []))
        ids = row_ids(cols, n, self.id_column)
        keys = unique_keys(ids)
        cells = media_cells(cols, n, self.media_columns, ids, image_cell)
        good = [ImageItem(k, c, (), self.base_dir) for k, c in zip(keys, cells)
                if not isinstance(c, ItemError)]
        done: dict[str, bytes | ItemError] = {}
        for p in prepared_groups(self.task, [good] if good else [], self.plan, self.opts,
                                 workers=self.workers):
            for it, im in zip(p.items, p.images):
                done[it.id] = p.errors[it.id] if im is None else pickle.dumps((self.key, im))
        out = [c if isinstance(c, ItemError) else done[k] for k, c in zip(keys, cells)]
        pa = _pa()
        table = {"id": pa.array(ids, pa.string()),
                 PREPARED: pa.array([x if isinstance(x, bytes) else None for x in out],
                                    pa.binary()),
                 PREPARE_ERROR: pa.array([x.message if isinstance(x, ItemError) else None
                                          for x in out], pa.string()),
                 PREPARE_ERROR_KIND: pa.array([x.kind.value if isinstance(x, ItemError)
                                               else None for x in out], pa.string())}
        return pa.table({**table, **{c: pa.array(cols[c]) for c in self.carry}})

    def __del__(self) -> None:
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.stop()


class Embedder:
    """``map_batches(Embedder, ...)``: one unit vector per row (``VLM.embed_many``) of its
    image (``image_column``), its text (``text_column``) or both in one prompt. Out: ``id``,
    ``tokens``, ``embedding`` (list of float32; null when failed), ``error``, ``error_kind``;
    a bad image is its row's error. ``embed``: ``EmbedConfig`` options (``pooling``,
    ``dimensions``, ...); pooled vectors only (a multi-vector config is refused).
    ``vlm_options``: ``VLM``'s. The model: the built-in embedding model unless given."""

    def __init__(self, model: str | Path | None = None, *,  # noqa: PLR0913
                 image_column: str | None = "image", text_column: str | None = None,
                 id_column: str | None = None, embed: Mapping[str, Any] | None = None,
                 base_dir: str | Path | None = None, **vlm_options: Any) -> None:
        if image_column is None and text_column is None:
            raise ValueError("give image_column=, text_column= or both")
        self.vlm = VLM(model if model is not None else DEFAULT_EMBED_MODEL, **vlm_options)
        self.embed = dict(embed or {})
        if self.vlm.embedder(EmbedConfig(**self.embed)).resolved.multi_vector:
            raise ValueError("Embedder gives one vector per row: ask for a pooled embedding "
                             "(embed={'multi_vector': False} or a pooling)")
        self.image_column, self.text_column, self.id_column = image_column, text_column, id_column
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()

    def __call__(self, batch: Batch) -> Any:
        cols = columns(batch)
        n = len(next(iter(cols.values()), []))
        ids = row_ids(cols, n, self.id_column)
        texts = cols[self.text_column] if self.text_column else [None] * n
        cells = [image_cell(v) for v in cols[self.image_column]] if self.image_column \
            else [None] * n
        items = [EmbedItem(i, ids[i], None if isinstance(c, ItemError) else c, t or None,
                           self.base_dir) for i, (c, t) in enumerate(zip(cells, texts))
                 if not isinstance(c, ItemError) and (c is not None or t)]
        got = {e.index: e for e in self.vlm.embed_many(items, **self.embed)}
        rows = []
        for i, c in enumerate(cells):
            e = got.get(i)
            err = c if isinstance(c, ItemError) else None if e is not None else ItemError(
                ErrorKind.SOURCE, "nothing to embed: no image and no text")
            rows.append({"id": ids[i], "tokens": None if e is None else e.tokens,
                         "embedding": None if e is None or e.vector is None
                         else e.vector.astype(np.float32),
                         "error": err.message if err else e.error if e else None,
                         "error_kind": err.kind.value if err else e.error_kind.value
                         if e and e.error_kind else None})
        pa = _pa()
        return pa.table({"id": pa.array([r["id"] for r in rows], pa.string()),
                         "tokens": pa.array([r["tokens"] for r in rows], pa.int64()),
                         "embedding": pa.array([r["embedding"] for r in rows],
                                               pa.list_(pa.float32())),
                         "error": pa.array([r["error"] for r in rows], pa.string()),
                         "error_kind": pa.array([r["error_kind"] for r in rows], pa.string())})

    def __del__(self) -> None:
        vlm = getattr(self, "vlm", None)
        if vlm is not None:
            vlm.close()
