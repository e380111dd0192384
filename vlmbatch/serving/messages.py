"""What crosses the channel between the HTTP process and an engine process: one frozen
record per kind of message (``channel.Link`` pickles them; nothing else goes over it).

    to the engine process                          from it
    Start(config, hooks, index)        once        Ready(info) | StartFailed(error)  once
    Ask(rid, question, image)          a chat      Settled(answers, stats)   per turn
    Embed(rid, dims, prepared, images) embeddings  BatchDrained(batch_id, cancelled)
    RunBatch(batch_id, job)            a batch     BatchFailed(batch_id, message)
    CancelBatch(batch_id)                          BatchReleased(batch_id)
    Stop(timeout_s)                    the end

A chat question is the drive's ``Question`` from the HTTP request to the engine thread,
which makes the engine's ``Request`` of it as offline runs do (``pipeline.records.
request_of``). Images travel as ``channel.Packed`` (their arrays in the shared arena). A
request's answer is a ``Reply``: its result, or a ``Failure`` (an exception as plain
fields: ``APIError`` and ``EmbedRefused`` do not pickle with their fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmbatch.pipeline.hooks import FaultHooks
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import EmbedItem
from vlmbatch.pipeline.task import Prepared
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.serving.config import ServingConfig
from vlmbatch.serving.errors import APIError, EmbedRefused

if TYPE_CHECKING:
    from vlmbatch.preprocessing.video_plan import VideoPlan


@dataclass(frozen=True)
class Packed:
    """A prepared image as the engine process reads it: its arrays' layout in the arena
    (``(field, offset, shape, dtype)`` each) and the image without them (``meta``), or the
    whole image pickled (``layout`` None: it did not fit the arena's free space)."""
    meta: Any  # PreparedImage (its arrays None when in the arena), or a MediaItem whole
    layout: tuple[tuple[str, int, tuple[int, ...], str], ...] | None = None
    region: tuple[int, int] | None = None  # (offset, bytes) in the arena
    key: str = ""  # the image's cache key (``channel.Residents`` keeps regions by it)


# --- to the engine process ---

@dataclass(frozen=True)
class Start:
    config: ServingConfig
    hooks: FaultHooks
    index: int  # which engine (logs, device)


@dataclass(frozen=True)
class Ask:
    """One chat question about one image."""
    rid: int
    question: Question
    image: Packed


@dataclass(frozen=True)
class Embed:
    """A prepared group of embedding inputs (``prepared.images`` empty: they are
    ``images``, in the arena), pooled to ``dims`` (None: the model's full size)."""
    rid: int
    dims: int | None
    prepared: Prepared[EmbedItem]
    images: tuple[Packed | None, ...]


@dataclass(frozen=True)
class RunBatch:
    batch_id: str
    job: Path  # the batch's job folder


@dataclass(frozen=True)
class CancelBatch:
    batch_id: str


@dataclass(frozen=True)
class Stop:
    timeout_s: float


# --- from the engine process ---

@dataclass(frozen=True)
class EngineInfo:
    image_plan: ImagePlan  # how the chat engine's images are prepared (the HTTP side does)
    embed_plan: ImagePlan | None  # the embedding engine's; None: no embeddings
    embed_dims: int | None  # a pooled embedding's full size
    video_plan: VideoPlan | None = None  # the chat engine's clips (None: it takes none)


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed:
    error: BaseException


@dataclass(frozen=True)
class Failure:
    """A request's exception as fields."""
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str | None = None
    retry_after: int | None = None
    input_index: int | None = None  # an EmbedRefused's input
    refused: bool = False  # an EmbedRefused (else an APIError)

    def exception(self) -> Exception:
        if self.refused:
            return EmbedRefused(self.message, self.input_index, self.code or "invalid_value")
        return APIError(self.status, self.message, self.param, self.code, self.type,
                        self.retry_after)


def failure_of(e: BaseException) -> Failure:
    """``e`` as a request's answer on the wire (anything unexpected: a 500 naming it)."""
    if isinstance(e, APIError):
        return Failure(e.status, e.message, e.param, e.code, e.type, e.retry_after)
    if isinstance(e, EmbedRefused):
        return Failure(400, str(e), code=e.code, input_index=e.index, refused=True)
    return Failure(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


@dataclass(frozen=True)
class Reply:
    rid: int
    result: Any = None  # a Score (chat) or each item's embeddings (embed)
    failure: Failure | None = None


@dataclass(frozen=True)
class Counters:
    """What an engine thread has done (cumulative; ``/metrics`` exports them)."""
    interactive: int = 0  # chat questions answered
    batch: int = 0  # batch results recorded (questions; embedding inputs)
    calls: int = 0  # chat engine calls made (FaultHooks.score sees the count)
    prompt_tokens: int = 0  # the engines' prompt tokens (cached ones included)
    prefill_tokens: int = 0  # of those, computed
    depth: int = 0  # requests and calls queued, not yet taken (a gauge, not a count)


@dataclass(frozen=True)
class Settled:
    """The answers of one engine-thread turn, with the counters after it."""
    answers: tuple[Reply, ...]
    stats: Counters = field(default_factory=Counters)


@dataclass(frozen=True)
class BatchDrained:
    """The batch's job has nothing pending left, or was cancelled between groups."""
    batch_id: str
    cancelled: bool


@dataclass(frozen=True)
class BatchFailed:
    """The batch's job cannot run here, or stopped on an error of its own."""
    batch_id: str
    message: str


@dataclass(frozen=True)
class BatchReleased:
    """The batch was let go unrun (the server is stopping): left as it is."""
    batch_id: str


BatchEvent = BatchDrained | BatchFailed | BatchReleased
