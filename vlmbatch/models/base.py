"""What a model family gives the engine: the interface every ``models/<family>/`` implements.

A family is found by the checkpoint's ``config.json`` ``model_type`` (``models/registry.py``)
and turns a checkpoint folder into a ``LoadedModel``: a vision module (uint8 rows in the
family's layout -> LLM-ready embeddings), a ``Decoder`` (``embed_tokens``, ``prefill``,
``decode_step``), the tokenizer, and a prompt builder. It also says how its images are
prepared (``image_plan``: a ``preprocessing`` plan) and how its weight names map to ours
(for ``quant/``). Families know nothing of engines, caches or jobs.

Two kinds of vision module (``packed_vision``):

- tiles (InternVL): ``module(rows [N, *row_shape] uint8) -> [N, T, D_text]``, rows
  independent, so a batch may be cut anywhere;
- packed images (Qwen-VL): ``module(rows [N, *row_shape] uint8, dims: list of each image's
  ``grid.dims``) -> VisionOutput(embeds [M, D_text], deepstack)``, the images' rows
  concatenated and their tokens in the same order; a batch is cut only between images.

Records: ``ModelSpec`` (sizes read from config.json, no weights), ``Prompt`` (token ids with
the image span marked, and for M-RoPE families their positions), ``VisionOutput`` and
``DeepStack`` (Qwen3-VL's extra image features for the first decoder layers),
``ImageOptions`` (the run's image settings a plan is made from).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from vlmbatch.models.linear_attention import Branches
from vlmbatch.preprocessing.media import MediaPart
from vlmbatch.preprocessing.prepare import ImagePlan, PreparedImage

KV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [B, K, T, d], rotary applied


class TextSizes(Protocol):
    """The decoder sizes the engine and ``quant/`` read (``models.decoder.TextSpec``)."""

    @property
    def vocab(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def kinds(self) -> tuple[str, ...]: ...  # per layer "full" or "linear" (Qwen3.5)
    @property
    def qkv_layout(self) -> str: ...  # "separate" | "grouped" (quant/'s layer groups)


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's sizes (from its config files; no weights read). Families subclass it."""
    path: Path
    model_type: str
    text: TextSizes
    image_token_id: int


@dataclass(frozen=True)
class Prompt:
    """Token ids of one (image, question) prompt.

    Invariant: ``ids[image_start : image_start + image_len]`` are all the image token id, and
    the image's embeddings fill exactly that span, with the image's start and end markers
    (``<img>``/``</img>``, ``<|vision_start|>``/``<|vision_end|>``) at ``image_start - 1``
    and ``image_start + image_len``; ``prefix_len`` tokens (through the end marker) are shared
    by every question about the same image, so the prefix cache may reuse them. A text-only
    prompt (embeddings) has ``image_len == 0``.

    ``positions`` [3, L] long: M-RoPE positions (Qwen-VL), or None where the position is the
    sequence index (InternVL). They do not depend on what follows a token, so a prefill that
    continues after a cached prefix of k tokens uses ``positions[:, k:]``. A generated token
    at sequence index i >= L has position ``i + rope_delta`` on every axis.

    Several visual parts (``PromptBuilder.build_parts``): ``parts`` holds each part's token
    runs ``(start, length)`` in prompt order (a clip may have several: Qwen3-VL's temporal
    patches, InternVL's frames, with text between); part k's embeddings, in the vision
    module's output order, fill its runs one after another. ``image_start`` is then the first
    run's start and ``image_len`` reaches the last run's end (text between included), so
    ``prefix_len`` still ends after the last part's end marker. Empty for one image."""
    ids: tuple[int, ...]
    image_start: int
    image_len: int
    positions: torch.Tensor | None = field(default=None, compare=False)
    rope_delta: int = 0
    parts: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def prefix_len(self) -> int:
        return self.image_start + self.image_len + 1


class VisionOutput(NamedTuple):
    """A packed vision module's output for the images of one call, in order."""
    embeds: torch.Tensor  # [M, D_text]: every image's LLM tokens
    deepstack: tuple[torch.Tensor, ...] = ()  # Qwen3-VL: one [M, D_text] per DeepStack layer


class BudgetForward(NamedTuple):
    """A packed vision module at a fixed budget of rows (``cudagraph_pool.BudgetPool``, ONNX
    export): ``meta(module, dims, budget, device)`` makes the index maths of images with
    these ``grid.dims`` as tensors whose shapes depend on the budget only; ``forward(module,
    rows [budget, *row_shape], meta)`` -> (embeds, *deepstack), each ``[budget /
    rows_per_token, D_text]``, the images' tokens first. Image row counts (``prod(dims)``)
    are multiples of ``unit``."""
    meta: Callable[[Any, Sequence[tuple[int, ...]], int, torch.device], dict[str, torch.Tensor]]
    forward: Callable[[Any, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
    rows_per_token: int
    unit: int


@dataclass(frozen=True)
class DeepStack:
    """Qwen3-VL DeepStack input of one prefill call.

    ``mask`` [B, T] bool: the image positions among the new tokens. ``features``: one
    ``[M, D]`` per leading decoder layer, M = mask.sum(), rows in the mask's row-major order
    (row 0's image tokens, then row 1's, ...): the vision module's ``deepstack`` for the
    images of the batch, sliced like the embeddings where a cached prefix ends inside an
    image, concatenated in row order.
    """

    mask: torch.Tensor
    features: tuple[torch.Tensor, ...]


class Decoder(nn.Module, ABC):
    """A family's language model, as the engine drives it (shapes: B rows, T new tokens,
    right-padded, P cached tokens, D hidden, V vocabulary)."""

    spec: TextSizes
    embed_tokens: nn.Embedding
    layers: nn.ModuleList

    @abstractmethod
    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor,
                past: list[KV] | None = None, past_lengths: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, deepstack: DeepStack | None = None,
                state_at: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """embeds [B, T, D] after per layer (k, v) [B, K, P, d] (row b's first
        past_lengths[b] real); lengths [B] real new tokens; positions of the new tokens
        (``[3, B, T]`` M-RoPE; None: past_lengths[b] + t). Returns (logits of each row's
        last real token [B, V] float32, per layer (k, v) [B, K, T, d] of the new tokens).
        ``state_at`` [B, P]: a linear layer's state also after that many new tokens (its
        entry then has (1 + P) B rows, ``models/decoder.py``)."""

    def prefill_hidden(self, embeds: torch.Tensor, lengths: torch.Tensor,
                       past: list[KV] | None = None, past_lengths: torch.Tensor | None = None,
                       *, positions: torch.Tensor | None = None,
                       deepstack: DeepStack | None = None,
                       state_at: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """As ``prefill``, but every new position's last hidden state (after the final norm)
        ``[B, T, D]`` instead of the last token's logits: what embeddings pool."""
        raise NotImplementedError(f"{type(self).__name__} gives no hidden states yet: "
                                  "embeddings of this family are not supported")

    @abstractmethod
    def decode_step(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[KV],
                    key_valid: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """One token per row: embeds [B, 1, D], positions [B] long, kv per layer [B, K, S, d],
        key_valid [B, S] bool -> (logits [B, V] float32, per layer (k, v) [B, K, 1, d])."""

    def prefill_segments(self, embeds: torch.Tensor, positions: torch.Tensor,
                         segments: torch.Tensor, at: torch.Tensor,
                         past: list[KV] | None = None, past_lengths: torch.Tensor | None = None,
                         *, deepstack: DeepStack | None = None,
                         seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Prompts that share a prefix, one row per group: the shared tokens, then each
        prompt's own (``segments`` [B, T]: 0 shared, k >= 1 prompt k, -1 padding), each
        token seeing the past, the shared tokens and its own segment causally; positions
        each token's in its own prompt. Returns (logits [Q, V] float32 at the flat
        positions ``at`` [Q], per layer (k, v) [B, K, T, d])."""
        raise NotImplementedError(f"{type(self).__name__} cannot prefill several prompts "
                                  "in one row")

    def extend(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[KV],
               key_valid: torch.Tensor, new_mask: torch.Tensor,
               branches: Branches | None = None) -> tuple[torch.Tensor, list[KV]]:
        """N tokens per row after cached keys, each new token seeing the valid cached keys
        and the new tokens ``new_mask`` allows: embeds [B, N, D], positions [B, N] (M-RoPE
        [3, B, N]), kv per layer [B, K, S, d], key_valid [B, S] bool, new_mask [B, N, N]
        bool -> (logits of every new position [B, N, V] float32, per layer (k, v)
        [B, K, N, d]). ``branches``: which new tokens continue which row's state, for a
        decoder with linear-attention layers (``models/linear_attention.py``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot extend a cached prefix by "
                                  "several tokens: label sets of this family are not "
                                  "supported")

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind: ``"full"`` (attention: its ``past`` entry is per-token k, v) or
        ``"linear"`` (Qwen3.5's linear attention: its entry is the layer's recurrent state,
        ``(conv, recurrent)`` per row, which a call replaces rather than extends)."""
        return ("full",) * len(self.layers)

    def join_cache(self, cache: list[KV], new: list[KV]) -> list[KV]:
        """A cache followed by a call's output (``prefill`` / ``decode_step``), per layer."""
        return [(torch.cat([c[0], n[0]], 2), torch.cat([c[1], n[1]], 2))
                for c, n in zip(cache, new)]

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per row, the shapes and dtypes of the linear layers' state tensors in layer order
        (each layer's conv, then its recurrent state); empty without linear layers."""
        return []


class PromptBuilder(Protocol):
    def build(self, question: str, image: PreparedImage, system: str | None = None) -> Prompt:
        """A question about an image (the user turn's text), after ``system``'s turn when
        given, ending where the answer starts. A system turn comes before the image, so it is
        part of the shared prefix (``Prompt.prefix_len``)."""

    def build_parts(self, question: str, parts: Sequence[MediaPart],
                    system: str | None = None) -> Prompt:
        """A question about several visual parts in order (images, clips: ``MediaPart``),
        written as the family's reference processor writes them; ``Prompt.parts`` says where
        each part's embeddings go. One still image gives ``build``'s ids."""

    def answer_ids(self, text: str) -> tuple[int, ...]:
        """``text``'s token ids as the assistant's answer right after ``build``'s prompt
        (the chat template's text between the generation prompt and an answer, then
        ``text``: ``models/chat.py``): what a label set's choice is scored as."""

    def embed(self, text: str, image: PreparedImage | None) -> Prompt:
        """An embedding input: with an image, the family's user turn holding the image then
        ``text`` (no assistant turn; where the family's chat template opens the turn the same
        way, its first ``prefix_len`` ids equal ``build``'s for the same image, so the prefix
        cache serves both); without, ``text``'s own tokens as given (a family may wrap them
        as its embedding model was trained: ColQwen2's query template). ValueError for an
        empty one."""


@dataclass(frozen=True)
class ImageOptions:
    """The run's image settings (``--tiling``, ``--resize``, ...), validated by the config
    that carries them; ``None`` means the checkpoint's own value."""
    tiling: str
    max_tiles: int | None
    upscale_limit: float
    max_image_tokens: int | None
    resize: str = "opencv"  # --resize: "opencv" | "reference" (the processor's kernel)


@dataclass
class LoadedModel:
    spec: ModelSpec
    family: ModelFamily
    vision: nn.Module  # uint8 rows (family layout) -> embeddings (module docstring)
    llm: Decoder
    tokenizer: Any  # a transformers tokenizer
    prompts: PromptBuilder


class ModelFamily(ABC):
    """One family of checkpoints (InternVL, Qwen-VL, ...); registered by ``model_type``."""

    # embeddings (models/embedding.py): the pooling where a checkpoint declares none (one of
    # POOLINGS; jina-embeddings-v4's rule), and the text after the image of an image-only
    # input (jina's image prompt)
    default_pooling = "image-mean"
    image_prompt = "Describe the image."
    # whether embed gives one vector per token unless told otherwise (ColQwen2: the
    # checkpoint is a late-interaction model, its pooled states were never trained)
    multi_vector_default = False
    embeddings = True  # whether its prompts and decoder give embeddings at all
    # the vision module takes images packed as rows + dims (module docstring), not tiles
    packed_vision: bool = False

    @abstractmethod
    def read_spec(self, path: Path, config: dict) -> ModelSpec:
        """The checkpoint's sizes; ModelError naming what is unsupported."""

    @abstractmethod
    def normalise_key(self, key: str) -> str:
        """A weight name as the checkpoint's files spell it -> the family's normal form, in
        which decoder weights read ``language_model.*`` (``weight_key``)."""

    @abstractmethod
    def build(self, spec: ModelSpec, weights: dict, path: Path) -> tuple[nn.Module, Decoder]:
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

    def budget_forward(self, spec: ModelSpec) -> BudgetForward | None:
        """A packed vision module's static-shape form (CUDA graphs by token budget), or None
        where the family has none (tile modules: ``GraphPool`` buckets their batch)."""
        return None

    @abstractmethod
    def vision_input_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        """Shape of one row of the vision module's uint8 input (the graph pool's item)."""

    @abstractmethod
    def vision_output_shape(self, spec: ModelSpec) -> tuple[int, ...]:
        """Shape of the vision module's output per input row (tiles: tokens, text hidden
        size), or per image token (packed: text hidden size)."""

    def is_llm_key(self, key: str) -> bool:
        """Whether a normalised weight name belongs to the decoder (what W4A16 quantises)."""
        return key.startswith("language_model.") or key == "lm_head.weight"

    def llm_param(self, key: str) -> str | None:
        """A normalised decoder weight name -> our decoder's parameter name, None if it is
        not a decoder-layer weight. Our names are the checkpoint's without
        ``language_model.`` (``layers.0.self_attn.q_proj.weight``), for every family."""
        prefix = "language_model.layers."
        return key[len("language_model."):] if key.startswith(prefix) else None

    def llm_key(self, param: str) -> str:
        """Our decoder's parameter name -> its normalised weight name (the inverse of
        ``llm_param``, for every decoder parameter; ``lm_head.weight`` stays)."""
        return weight_key(param)


def weight_key(param: str) -> str:
    """A parameter name of ``models.decoder.TextDecoder`` -> its normalised weight name
    (``layers.0.self_attn.q_proj.weight`` -> ``language_model.layers.0.self_attn.q_proj.
    weight``; ``lm_head.weight`` stays): one scheme for every family."""
    return param if param == "lm_head.weight" else "language_model." + param
