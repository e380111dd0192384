"""What a job is made of, per kind of work: a ``JobTask`` pairs the pipeline ``Task`` its
items go through (``pipeline/task.py``: stage 1 and 2, the same for every executor) with the
job side of those items: where they come from (``items``), what is checked at submit
(``check``), and how the store keeps them (``to_json``/``from_json``).

    AnswerJob    ImageItem -> Answer per question     manifests, folders, OpenAI chat lines,
                                                      Parquet/HF datasets, WebDataset shards
    EmbedJob     EmbedItem -> one Embedding           embedding manifests, folders
    RequestJob   EmbedRequestItem -> one per string   OpenAI /v1/embeddings batch lines
                                                      (``RequestTask`` below)

``job_task(cfg, fmt)`` picks one from the run's task (``RunConfig.task``) and the input's
format (``"openai"`` or ``"vlmbatch"``: a job's ``job.json`` keeps it, so a job runs from its
store alone, after its manifest is gone).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.embed import check_embed_config
from vlmbatch.engine.loading import text_tokens
from vlmbatch.engine.records import EmbedRequest
from vlmbatch.inputs import embed_input
from vlmbatch.inputs.datasets import iter_dataset
from vlmbatch.inputs.manifest import first_line, items_from_folder, iter_manifest, read_policy
from vlmbatch.inputs.openai_embeddings import (
    MAX_INPUT_TOKENS,
    MAX_REQUEST_TOKENS,
    EmbedRequestItem,
    iter_embed_requests,
)
from vlmbatch.jobs.config import RunConfig
from vlmbatch.jobs.store import image_item_from_json, image_item_to_json
from vlmbatch.pipeline.config import PrepareConfig
from vlmbatch.pipeline.hooks import Named
from vlmbatch.pipeline.media_inputs import SamplingKeys, VideoInput
from vlmbatch.pipeline.questions import ManifestError, PromptLimits, Question
from vlmbatch.pipeline.records import Answer, Embedding, EmbedItem, ErrorKind, ImageItem, ItemError
from vlmbatch.pipeline.task import AnswerTask, EmbedTask, Prepared, Task

if TYPE_CHECKING:
    from vlmbatch.engine.base import Engine
    from vlmbatch.engine.config import EmbedConfig

I = TypeVar("I", bound=Named)  # noqa: E741  (an item)
R = TypeVar("R")  # a result
# (where, item) of a run's input, streamed, and for a manifest where a repeated id was first
# (called on that error only)
Items = tuple[Iterator[tuple[str, I]], Callable[[str], str] | None]


class JobTask(ABC, Generic[I, R]):
    task: Task[I, R]

    @abstractmethod
    def items(self, cfg: RunConfig) -> Items[I]:
        """The run's input items, streamed, each with where it was read."""

    def check(self, cfg: RunConfig) -> None:
        """Raise ConfigError for options the checkpoint cannot meet (at submit, before any
        work); the model folder itself is checked by the caller."""

    @abstractmethod
    def to_json(self, item: I) -> str: ...

    @abstractmethod
    def from_json(self, text: str) -> I: ...


def with_sampling(item: ImageItem, prepare: PrepareConfig) -> ImageItem:
    """``item`` with the run's clip sampling keys (``--fps``...) folded into its own (a line's
    win), so a job's store keeps them and a resumed run samples as submitted."""
    if not isinstance(item.image, VideoInput):
        return item
    run = SamplingKeys(prepare.fps, prepare.num_frames, prepare.max_frames,
                       prepare.max_video_tokens, prepare.segment_seconds,
                       prepare.segment_stride)
    clip = VideoInput(item.image.source, item.image.sampling.over(run))
    return ImageItem(item.id, clip, item.questions, item.base_dir)


class AnswerJob(JobTask[ImageItem, Answer]):
    """Yes/no questions about images (``vlmbatch run``/``submit``)."""

    def __init__(self) -> None:
        self.task = AnswerTask()

    def items(self, cfg: RunConfig) -> Items[ImageItem]:
        policy = read_policy(cfg.policy) if cfg.policy else ()
        limits = prompt_limits(cfg, policy)
        if cfg.dataset is not None:
            return checked(iter_dataset(cfg.dataset, cfg.image_column, cfg.id_column,
                                        cfg.questions_column, policy, cfg.prepare.fetch),
                           limits), None
        manifest = cfg.manifest
        if manifest is not None:
            def first(item_id: str) -> str:
                return f"line {first_line(manifest, item_id, policy)}"

            return ((f"{manifest}:{ln}", with_sampling(it, cfg.prepare))
                    for ln, it in iter_manifest(manifest, policy, limits=limits)), first
        assert cfg.images is not None  # a folder's questions: the policy's, checked already
        return ((str(cfg.images), it) for it in items_from_folder(cfg.images, policy)), None

    def to_json(self, item: ImageItem) -> str:
        return image_item_to_json(item)

    def from_json(self, text: str) -> ImageItem:
        return image_item_from_json(text)


def prompt_limits(cfg: RunConfig, policy: tuple[Question, ...] = ()) -> PromptLimits:
    """The run's question limits (``--max-prompt-chars``, the model's context: its tokenizer
    and config read, not its weights), the policy's questions checked with them now, the
    error naming the policy file."""
    count, context = text_tokens(cfg.model.path)
    limits = PromptLimits(cfg.max_prompt_chars, context, count)
    for q in policy:
        limits.check(q, str(cfg.policy))
    return limits


def checked(items: Iterable[tuple[str, ImageItem]], limits: PromptLimits
            ) -> Iterator[tuple[str, ImageItem]]:
    """``items`` (where each was read, the item), each question's length checked."""
    for where, it in items:
        for q in it.questions:
            limits.check(q, where)
        yield where, it


class EmbedJob(JobTask[EmbedItem, Embedding]):
    """One embedding per item (``submit --task embed``)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.task = EmbedTask(cfg.embed)

    def items(self, cfg: RunConfig) -> Items[EmbedItem]:
        manifest = cfg.manifest
        if manifest is not None:
            def first(item_id: str) -> str:
                lines = embed_input.iter_embed_manifest(manifest)
                return f"line {next(ln for ln, it in lines if it.key == item_id)}"

            return ((f"{manifest}:{ln}", it)
                    for ln, it in embed_input.iter_embed_manifest(manifest)), first
        assert cfg.images is not None
        return ((str(cfg.images), it) for it in embed_input.folder_items(cfg.images)), None

    def check(self, cfg: RunConfig) -> None:
        check_embed_config(cfg.model.path, cfg.embed)

    def to_json(self, item: EmbedItem) -> str:
        return embed_input.embed_item_to_json(item)

    def from_json(self, text: str) -> EmbedItem:
        return embed_input.embed_item_from_json(text)


class RequestJob(JobTask[EmbedRequestItem, Embedding]):
    """An OpenAI batch file of ``/v1/embeddings`` requests: one item per request holding its
    strings (``inputs/openai_embeddings.py``), one pooled vector per string, whatever the
    checkpoint's default (a ColQwen2 one is multi-vector)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.task = RequestTask(dataclasses.replace(cfg.embed, multi_vector=False))

    def items(self, cfg: RunConfig) -> Items[EmbedRequestItem]:
        manifest = cfg.manifest
        assert manifest is not None

        def first(item_id: str) -> str:
            lines = iter_embed_requests(manifest)
            return f"line {next(ln for ln, r in lines if r.custom_id == item_id)}"

        return ((f"{manifest}:{ln}", r)
                for ln, r in iter_embed_requests(manifest)), first

    def check(self, cfg: RunConfig) -> None:
        """What the server's batches check: each request's dimensions one of the model's
        sizes; --multi-vector and --dimensions do not apply."""
        sizes = check_embed_config(cfg.model.path, cfg.embed).spec.matryoshka_dims
        if cfg.embed.multi_vector or cfg.embed.dimensions is not None:
            raise ConfigError("a file of /v1/embeddings requests gives one vector per string, "
                              "at each request's body.dimensions: --multi-vector and "
                              "--dimensions do not apply to it")
        assert cfg.manifest is not None
        for ln, r in iter_embed_requests(cfg.manifest):
            if r.dimensions is not None and r.dimensions not in sizes:
                have = (f"declares the sizes {list(sizes)}: give one of them" if sizes
                        else "declares no Matryoshka sizes")
                raise ManifestError(f"{cfg.manifest}:{ln}: body.dimensions {r.dimensions}: "
                                    f"the model {have}, or leave dimensions out for its full "
                                    "size")

    def to_json(self, item: EmbedRequestItem) -> str:
        return item.to_json()

    def from_json(self, text: str) -> EmbedRequestItem:
        return EmbedRequestItem.from_json(text)


def job_task(cfg: RunConfig, fmt: str) -> JobTask:
    """The job task of a run (``cfg.task``) over an input in format ``fmt`` (``"openai"``
    or ``"vlmbatch"``, ``inputs.manifest.manifest_format``)."""
    if cfg.task == "answer":
        return AnswerJob()
    return RequestJob(cfg) if fmt == "openai" else EmbedJob(cfg)


# --- a job of OpenAI /v1/embeddings requests (inputs/openai_embeddings.py) ---

def limited(results: list[Embedding]) -> list[Embedding]:
    """One request's results, the first input over ``MAX_INPUT_TOKENS`` (else the one that
    takes the request over ``MAX_REQUEST_TOKENS``) failed (``too_large``): the limits
    ``/v1/embeddings`` refuses a request over."""
    total = 0
    for k, e in enumerate(results):
        tokens = e.tokens or 0
        total += tokens
        if tokens > MAX_INPUT_TOKENS:
            why = f"{tokens:,} tokens, over the limit of {MAX_INPUT_TOKENS:,} per input"
        elif total > MAX_REQUEST_TOKENS:
            why = f"the request's inputs reach {total:,} tokens here, over the limit of " \
                  f"{MAX_REQUEST_TOKENS:,} per request"
        else:
            continue
        failed = Embedding(e.index, e.id, e.tokens, None, why, ErrorKind.TOO_LARGE)
        return [*results[:k], failed, *results[k + 1:]]
    return results


@dataclass(frozen=True)
class RequestTask(Task[EmbedRequestItem, Embedding]):
    """Each request's strings embedded together, one pooled vector per string whatever the
    checkpoint's default (``cfg.multi_vector`` False, as ``/v1/embeddings``): results are one
    ``Embedding`` per string (``id`` the request's ``custom_id``, ``index`` the string's place
    in its ``input``); a request over the token limits fails (``limited``). Texts need no
    stage 1, so a request whose prepare task was lost (a Ray worker that died) is embedded
    all the same."""
    cfg: EmbedConfig
    name = "embed"

    def key(self, item: EmbedRequestItem) -> str:
        return item.custom_id

    def image(self, item: EmbedRequestItem) -> None:
        return None

    def run(self, engine: Engine, p: Prepared[EmbedRequestItem]) -> list[list[Embedding]]:
        vectors = iter(engine.embed([], [EmbedRequest(None, t) for r in p.items
                                         for t in r.texts], self.cfg))
        return [limited([Embedding(i, r.custom_id, v.tokens, v.values)
                         for i, v in zip(range(len(r.texts)), vectors)]) for r in p.items]

    def failed(self, item: EmbedRequestItem, err: ItemError) -> list[Embedding]:
        return [Embedding(i, item.custom_id, None, None, err.message, err.kind)
                for i in range(len(item.texts))]
