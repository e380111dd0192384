"""What crosses the engine's interface (``engine/base.py``): a ``Request`` (one question
about one prepared image) in, a ``Score`` out; an ``EmbedRequest`` in, a ``Vector`` out.
The drive's records (``ImageItem``, ``Answer``, ...) are in ``pipeline/records.py`` and are
built from these; the engine never sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:  # types only: importing them loads OpenCV, which light modules must not
    from vlmbatch.preprocessing.media import MediaPart
    from vlmbatch.preprocessing.prepare import PreparedImage


@dataclass(frozen=True, eq=False)
class MediaItem:
    """An item holding several visual parts in prompt order (images, clips), where
    ``Engine.score`` takes an image: the family writes them into one prompt
    (``PromptBuilder.build_parts``), the prefix cache keys each part by its content
    (``planner.py``), a clip's frame groups are encoded once each (``engine/features.py``)."""
    parts: tuple[MediaPart, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a media item needs at least one image or clip")

    @property
    def cache_key(self) -> str:
        return "parts:" + "|".join(p.cache_key for p in self.parts)


# what ``Engine.score`` takes per item: one still image (bit-identical to before), or several
# parts
Item: TypeAlias = "PreparedImage | MediaItem"


@dataclass(frozen=True)
class Request:
    image: int  # index into the items (images or ``MediaItem``s) passed to ``Engine.score``
    question: str  # the user turn's text (``Question.user_text``)
    max_new_tokens: int | None = None  # answer tokens to generate; None: the engine's
    choices: tuple[str, ...] = ()  # a label set to score (``Score.logprobs``)
    system: str | None = None  # the system turn, if any


@dataclass(frozen=True)
class Score:
    p_yes: float
    margin: float  # logsumexp(yes logits) - logsumexp(no logits)
    image_tokens: int
    text: str | None = None  # greedy answer text when max_new_tokens > 0
    prompt_tokens: int | None = None  # the prompt's tokens (image ones included); None: unknown
    # a label set's log-likelihoods, in the request's choice order (None: a yes/no request):
    # log P(choice | prompt) summed over the choice's tokens, or its first token's alone
    # (--choice-scoring first-token)
    logprobs: tuple[float, ...] | None = None
    completion_tokens: int | None = None  # tokens of ``text`` generated; None: no text/unknown


@dataclass(frozen=True)
class EmbedRequest:
    image: int | None  # index into the images passed to ``EmbedHandle.embed``; None: text only
    text: str | None  # None: the image alone (the family's image prompt follows it)


@dataclass(frozen=True, eq=False)
class Vector:
    """What the embedder returns per request: unit float32 ``values`` ``[D]`` (pooled) or
    ``[T, D]`` (multi-vector, one unit row per token), and the prompt's token count (special
    tokens included: what an OpenAI ``usage`` counts)."""
    values: np.ndarray
    tokens: int
