"""The engine interface: ``score(images, requests) -> scores``.

An engine takes prepared images (``preprocessing.PreparedImage``, made with its own
``image_plan``) and one ``Request`` per question, and returns one ``Score`` per request, in
order. Backends are builders named in ``engine/build.py``'s ``ENGINES`` (ours:
``engine/torch_engine.py``; LMDeploy's TurboMind: ``engine/lmdeploy_engine.py``);
``engine.build.build_engine`` picks one by name. What callers may read besides ``score``
is ``image_plan``, ``summary()`` and, where the engine can, ``embed``/``embedding``: no
engine's internals (its cache, its planner, its vision runner).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.records import EmbedRequest, Item, Request, Score, Vector
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage

if TYPE_CHECKING:
    from vlmbatch.engine.config import EmbedConfig, Resolved
    from vlmbatch.models.base import Prompt
    from vlmbatch.preprocessing.video_plan import VideoPlan


@dataclass
class EngineStats:
    vision_tiles: int = 0  # tiles (vision rows) through the vision encoder
    prefill_tokens: int = 0  # real tokens computed by the LLM
    image_tokens_prefilled: int = 0  # of those, image tokens
    prompt_tokens: int = 0  # real tokens of all prompts (what a cacheless engine computes)


@dataclass(frozen=True)
class EngineSummary:
    """What a run reports about its engine (``RunSummary``)."""
    prefill_tokens: int
    prompt_tokens: int
    cache_hit_rate: float | None  # cached blocks found / looked up; None: no prefix cache
    graph_buckets: int = 0  # CUDA graphs captured for the vision encoder
    graph_bytes: int = 0  # device memory those graphs took at capture


class Engine(ABC):
    stats: EngineStats
    image_plan: ImagePlan  # how images must be prepared for this engine
    # how clips must be prepared for it (the checkpoint's video processor); None: it takes
    # none (an item with a clip is that item's error)
    video_plan: VideoPlan | None = None

    @abstractmethod
    def score(self, images: list[Item], requests: list[Request]) -> list[Score]:
        """One score per request, in order; ``Request.image`` indexes ``images`` (one still
        image, or a ``MediaItem``: several images or a clip, where the engine takes them). A request
        with a label set gets its choices' log-likelihoods (``Score.logprobs``)."""

    def context_error(self, item: Item, request: Request) -> str | None:
        """Why ``request``'s prompt about ``item`` cannot fit the model's context (a message
        naming its tokens and the context), None where it fits or this engine does not
        check; ``score`` must not be given such a request."""
        return None

    def check_choices(self, choices: tuple[str, ...]) -> None:
        """ConfigError (``ChoiceError``) if this engine cannot score the label set ``choices``
        as configured (naming the choices it cannot tell apart); called before any work by
        the commands that can."""
        raise ConfigError(f"label sets (choices) are scored by the torch engine (--engine "
                          f"torch), not {type(self).__name__}")

    def embedding(self, cfg: EmbedConfig) -> Resolved:
        """What ``embed`` does with ``cfg`` on this checkpoint; ConfigError if it cannot."""
        raise ConfigError(f"embeddings run on the torch engine (--engine torch), not "
                          f"{type(self).__name__}")

    def embed(self, images: list[PreparedImage], requests: list[EmbedRequest],
              cfg: EmbedConfig) -> list[Vector]:
        """One vector per request, in order (``EmbedRequest.image`` indexes ``images``)."""
        raise ConfigError(f"embeddings run on the torch engine (--engine torch), not "
                          f"{type(self).__name__}")

    def embed_prompt(self, request: EmbedRequest, images: list[PreparedImage],
                     cfg: EmbedConfig) -> Prompt:
        """The prompt ``embed`` builds for ``request`` (its tokens: what ``Vector.tokens``
        counts and a reference computation reads)."""
        raise ConfigError(f"embeddings run on the torch engine (--engine torch), not "
                          f"{type(self).__name__}")

    def summary(self) -> EngineSummary:
        return EngineSummary(self.stats.prefill_tokens, self.stats.prompt_tokens, None)
