"""What a model family gives the engine: the interface every ``models/<family>/`` implements.

A family is found by the checkpoint's ``config.json`` ``model_type`` (``models/registry.py``)
and turns a checkpoint folder into a ``LoadedModel``: a vision module (uint8 pixels in the
family's layout -> LLM-ready embeddings), a decoder with the ``Qwen2LM`` interface
(``embed_tokens``, ``prefill``, ``decode_step``), the tokenizer, and a prompt builder. It
also says how its images are prepared (``image_plan``: a ``preprocessing`` plan) and how its
weight names map to ours (for ``quant/``). Families know nothing of engines, caches or jobs.

Records: ``ModelSpec`` (sizes read from config.json, no weights), ``Prompt`` (token ids with
the image span marked), ``ImageOptions`` (the run's image settings a plan is made from).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from models.qwen2 import Qwen2LM, TextSpec
from preprocessing.prepare import ImagePlan, PreparedImage


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's sizes (from its config files; no weights read). Families subclass it."""
    path: Path
    model_type: str
    text: TextSpec
    image_token_id: int


@dataclass(frozen=True)
class Prompt:
    """Token ids of one (image, question) prompt.

    Invariant: ``ids[image_start : image_start + image_len]`` are all the image token id, and
    the image's embeddings fill exactly that span, with the image's start and end markers
    (``<img>``/``</img>``, ``<|vision_start|>``/``<|vision_end|>``) at ``image_start - 1``
    and ``image_start + image_len``; ``prefix_len`` tokens (through the end marker) are shared
    by every question about the same image, so the prefix cache may reuse them. A text-only
    prompt (embeddings) has ``image_len == 0``."""
    ids: tuple[int, ...]
    image_start: int
    image_len: int

    @property
    def prefix_len(self) -> int:
        return self.image_start + self.image_len + 1


class PromptBuilder(Protocol):
    def build(self, question: str, image: PreparedImage) -> Prompt:
        """A yes/no question about an image, ending where the answer starts."""

    def embed(self, text: str, image: PreparedImage | None) -> Prompt:
        """An embedding input: with an image, the family's user turn holding the image then
        ``text`` (no assistant turn), its first ``prefix_len`` ids equal to ``build``'s for the
        same image; without, ``text``'s own tokens as given. ValueError for an empty one."""


@dataclass(frozen=True)
class ImageOptions:
    """The run's image settings (``--tiling``, ``--max-tiles``, ...), validated by the config
    that carries them; ``None`` means the checkpoint's own value."""
    tiling: str
    max_tiles: int | None
    upscale_limit: float
    max_image_tokens: int | None


@dataclass
class LoadedModel:
    spec: ModelSpec
    family: ModelFamily
    vision: nn.Module  # uint8 pixels (family layout) -> [N, T, D_text] embeddings
    llm: Qwen2LM
    tokenizer: Any  # a transformers tokenizer
    prompts: PromptBuilder


class ModelFamily(ABC):
    """One family of checkpoints (InternVL, Qwen-VL, ...); registered by ``model_type``."""

    # embeddings (models/embedding.py): the pooling where a checkpoint declares none (one of
    # POOLINGS; jina-embeddings-v4's rule), and the text after the image of an image-only
    # input (jina's image prompt)
    default_pooling = "image-mean"
    image_prompt = "Describe the image."

    @abstractmethod
    def read_spec(self, path: Path, config: dict) -> ModelSpec:
        """The checkpoint's sizes; ModelError naming what is unsupported."""

    @abstractmethod
    def normalise_key(self, key: str) -> str:
        """A weight name as the checkpoint's files spell it -> the family's normal form, in
        which decoder weights read ``language_model.*`` (``models.qwen2.hf_key``)."""

    @abstractmethod
    def build(self, spec: ModelSpec, weights: dict, path: Path) -> tuple[nn.Module, Qwen2LM]:
        """Float vision module and decoder on the CPU, loaded from normalised ``weights``."""

    @abstractmethod
    def load_tokenizer(self, path: Path) -> Any:
        """The checkpoint's tokenizer; ModelError if it lacks what the prompts need."""

    @abstractmethod
    def prompt_builder(self, tokenizer: Any, spec: ModelSpec) -> PromptBuilder: ...

    @abstractmethod
    def image_plan(self, spec: ModelSpec, options: ImageOptions) -> ImagePlan:
        """How this checkpoint's images are prepared under the run's options; ValueError
        saying why if the options cannot be met (e.g. a token budget below one tile)."""

    @abstractmethod
    def vision_input_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        """Shape of one row of the vision module's uint8 input (the graph pool's item)."""

    @abstractmethod
    def vision_output_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        """Shape of the vision module's output per input row (tokens, text hidden size)."""

    def is_llm_key(self, key: str) -> bool:
        """Whether a normalised weight name belongs to the decoder (what W4A16 quantises)."""
        return key.startswith("language_model.") or key == "lm_head.weight"

    def llm_param(self, key: str) -> str | None:
        """A normalised decoder weight name -> our ``Qwen2LM`` parameter name
        (``language_model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.q_proj.weight``),
        None if it is not a decoder-layer weight."""
        parts = key.split(".")
        if parts[:2] != ["language_model", "layers"] or len(parts) != 6:
            return None
        return ".".join([*parts[1:3], *parts[4:]])
