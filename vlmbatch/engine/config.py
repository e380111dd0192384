"""The engine side of the one frozen config tree: ``ModelConfig`` (which checkpoint, where,
how its images are prepared) and ``EngineConfig`` (how it is run). ``jobs.config.RunConfig``
holds both, with the run's input, output and executor; the CLI builds it.

Validation lives in ``__post_init__`` so a bad value fails before any model is loaded. Each
choice list is written once here (or in the registry that owns it) and read by the CLI's
``choices``; each default is the dataclass field's, which the CLI reads too.

Light by design (``--help`` and ``status`` import it): no torch, no model or runner code. The
dtype and the device are names, checked here as strings (``DTYPES``; ``cpu``, ``cuda``,
``cuda:N`` as ``torch.device`` reads them) and resolved where the model is loaded
(``engine/loading.py``); choice lists come from registry names and light constants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vlmbatch.models.embedding import POOLINGS, EmbeddingSpec

# re-exported: where the built-in checkpoints live (models/paths.py)
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL as DEFAULT_EMBED_MODEL
from vlmbatch.models.paths import DEFAULT_MODEL as DEFAULT_MODEL
from vlmbatch.models.paths import DEFAULT_QWEN_MODEL as DEFAULT_QWEN_MODEL
from vlmbatch.preprocessing.tiling import TILING_MODES
from vlmbatch.vit_trt import RUNNERS


class ConfigError(ValueError):
    """A bad option or config value, found before any work starts."""


class AnswerWordsError(ValueError):
    """The yes/no answer words do not fit the model's vocabulary (found when the engine is
    built: ``engine/scoring.py``)."""


class ChoiceError(ConfigError):
    """A label set the engine cannot score as asked: two choices whose tokens are the same
    (or, with ``--choice-scoring first-token``, start with the same token); the message names
    them (``engine/scoring.py``)."""


LLM_QUANT = ("none", "int8-dynamic")
# how a label set's choices are scored: each choice's whole token sequence after the prompt
# (exact), or its first token only (cheaper; choices must then start with different tokens)
CHOICE_SCORING = ("exact", "first-token")
QUESTION_ROWS = ("auto", "on", "off")  # EngineConfig.question_rows
QUANT = ("none", "fp8")  # W8A8 of the decoder's and the vision encoder's linears
# dtype names; engine/loading.py maps each to its torch dtype where the model is loaded
DTYPES = ("float32", "bfloat16", "float16")
# the device strings torch.device reads as a CPU or CUDA device: cpu, cuda, cuda:N (and
# cpu:N), N a decimal index without leading zeros that torch's int32 parse accepts
_DEVICE = re.compile(r"(cpu|cuda)(?::(0|[1-9][0-9]*))?")
# inputs per embedder call unless a run says otherwise: one prompt per input (a yes/no group
# of 16 images holds 16 x its questions), so a larger group fills the same prefill batches
# and costs fewer, larger forwards
EMBED_GROUP = 64


def vit_backends() -> tuple[str, ...]:
    """``--vit-backend`` choices: ``auto`` and every registered runner."""
    return ("auto", *RUNNERS.names())


def device_ok(device: object) -> bool:
    """``device`` names a CPU or CUDA device as ``torch.device`` would read it (tested
    against it), without importing torch."""
    m = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    return m is not None and (m[2] is None or int(m[2]) < 2**31)


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name`` (what the CLI shows and uses)."""
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True)
class ModelConfig:
    path: Path | None = None  # None: the built-in model (DEFAULT_MODEL)
    device: str = "cpu"
    dtype: str = "float32"  # one of DTYPES (a name: loading.py resolves it)
    max_tiles: int | None = None  # override the checkpoint's max tiles per image
    # "reduced" (fewest tiles that keep the image's resolution, letterboxed; the default since
    # the built-in model trains on it too) | "reference" (InternVL's dynamic_preprocess)
    tiling: str = "reduced"
    upscale_limit: float = 1.0  # reduced tiling: most a tile count may enlarge an image
    max_image_tokens: int | None = None  # per-image token budget (thumbnail included)
    llm_quant: str = "none"  # "none" | "int8-dynamic" (CPU); W4A16 comes from the checkpoint
    # "fp8": e4m3 W8A8 linears (decoder and vision encoder) through torch._scaled_mm on CUDA
    # (compute capability >= 8.9); on the CPU a slow reference of the same arithmetic
    quant: str = "none"

    def __post_init__(self) -> None:
        if not device_ok(self.device):
            raise ConfigError(f"device {self.device!r} not supported: use cpu, cuda or cuda:N")
        if self.llm_quant not in LLM_QUANT:
            raise ConfigError(f"llm_quant {self.llm_quant!r} not one of {LLM_QUANT}")
        if self.quant not in QUANT:
            raise ConfigError(f"quant {self.quant!r} not one of {QUANT}")
        if self.quant != "none" and self.llm_quant != "none":
            raise ConfigError(f"--quant {self.quant} and --llm-quant {self.llm_quant} both "
                              "quantise the decoder's linears; give one")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not one of {sorted(DTYPES)}")
        if self.max_tiles is not None and self.max_tiles < 1:
            raise ConfigError(f"max_tiles must be >= 1, got {self.max_tiles}")
        if self.tiling not in TILING_MODES:
            raise ConfigError(f"tiling {self.tiling!r} not one of {TILING_MODES}")
        if self.max_image_tokens is not None and self.max_image_tokens < 1:
            raise ConfigError(f"max_image_tokens must be >= 1, got {self.max_image_tokens}")
        if not self.upscale_limit > 0:
            raise ConfigError(f"upscale_limit must be > 0, got {self.upscale_limit}")

    @property
    def model_dir(self) -> Path:
        return self.path if self.path is not None else DEFAULT_MODEL


@dataclass(frozen=True)
class EngineConfig:
    # one of pipeline.build.ENGINES (checked when built): torch (ours, CPU/CUDA), lmdeploy
    engine: str = "torch"
    vit_backend: str = "auto"  # one of vit_backends()
    cuda_graphs: bool = True  # torch/tensorrt vision backends on CUDA: batch-bucketed graph pool
    max_batch_tokens: int = 8192  # padded prompt tokens per LLM forward
    max_batch_tiles: int = 64  # tiles per vision-encoder forward
    # largest vision batch a runner prepares for: the graph pool's largest bucket, the
    # TensorRT profile's maximum; larger forwards are split
    vit_max_batch: int = 32
    # the decoder's prefill through torch.compile (dynamic shapes); off by default: its gain
    # on a GPU has not been measured yet (bench/qpm.py --compile-llm, bench/gpu_check.sh)
    compile_llm: bool = False
    prefix_cache: bool = True  # image-aware prefix KV cache (engine/prefix_cache.py)
    block_size: int = 16  # tokens per cache block
    cache_bytes: int = 1 << 30  # LRU budget for cached KV
    max_new_tokens: int = 0  # > 0: also generate a greedy text answer of up to this length
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks of long answers)
    # Words that are not one token of the model's vocabulary are skipped (是/否 are single
    # tokens in Qwen2's vocabulary, not in the built-in model's).
    yes_words: tuple[str, ...] = ("yes", "Yes", "YES", "是")
    no_words: tuple[str, ...] = ("no", "No", "NO", "否")
    choice_scoring: str = "exact"  # one of CHOICE_SCORING
    # an image's prefix and its yes/no questions in one row, one forward (engine/packing.py):
    # "auto" where the host is the bottleneck (CUDA), else the leaders/followers phases,
    # which compute less (the CPU is bound by arithmetic: docs/engine.md, "Host cost")
    question_rows: str = "auto"  # one of QUESTION_ROWS

    def __post_init__(self) -> None:
        if self.question_rows not in QUESTION_ROWS:
            raise ConfigError(f"question_rows {self.question_rows!r} not one of "
                              f"{QUESTION_ROWS}")
        if min(self.max_batch_tokens, self.max_batch_tiles, self.block_size,
               self.vit_max_batch) < 1:
            raise ConfigError("max_batch_tokens, max_batch_tiles, vit_max_batch and block_size "
                              "must be >= 1")
        if self.vit_backend not in vit_backends():
            raise ConfigError(f"vit_backend {self.vit_backend!r} not one of {vit_backends()}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.ignore_eos and not self.max_new_tokens:
            raise ConfigError("ignore_eos (--ignore-eos) only applies to generated text: give "
                              "max_new_tokens (--max-new-tokens N) too (a question's own "
                              "max_new_tokens, 0 included, still overrides it)")
        if self.cache_bytes < 0:
            raise ConfigError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if not self.yes_words or not self.no_words:
            raise ConfigError("yes_words and no_words must not be empty")
        if self.choice_scoring not in CHOICE_SCORING:
            raise ConfigError(f"choice_scoring {self.choice_scoring!r} not one of "
                              f"{CHOICE_SCORING}")


@dataclass(frozen=True)
class EmbedConfig:
    """How inputs become vectors (``engine/embed.py``); checked against the checkpoint's
    declarations (``models/embedding.py``) when an embedder is built."""
    pooling: str | None = None  # one of POOLINGS; None: the checkpoint's, else its family's
    dimensions: int | None = None  # Matryoshka: keep the first N components, re-normalise
    force_dimensions: bool = False  # truncate where the checkpoint declares no such size
    # one unit vector per token (after the checkpoint's projection); None: the checkpoint's
    # default (ColQwen2: yes, unless --pooling or --dimensions asks for a pooled vector)
    multi_vector: bool | None = None
    prompt: str | None = None  # text after an image-only input's image; None: the family's
    query_prefix: str = ""  # put before a text-only input's text, as given
    document_prefix: str = ""  # put before the text of an input with an image, as given

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ConfigError(f"pooling {self.pooling!r} not one of {POOLINGS}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ConfigError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.force_dimensions and self.dimensions is None:
            raise ConfigError("--force-dimensions needs --dimensions N")
        if self.multi_vector and (self.dimensions is not None or self.pooling is not None):
            raise ConfigError("--multi-vector gives one vector per token: --pooling and "
                              "--dimensions apply to pooled (single-vector) embeddings")
        if self.prompt is not None and not self.prompt.strip():
            raise ConfigError("--prompt must not be empty")


@dataclass(frozen=True)
class Resolved:
    """An ``EmbedConfig`` checked against the checkpoint: what the embedder does."""
    pooling: str
    dimensions: int | None
    multi_vector: bool
    image_prompt: str
    spec: EmbeddingSpec
    hidden: int  # a pooled vector's full size (the decoder's hidden size)


def resolve(cfg: EmbedConfig, spec: EmbeddingSpec, image_prompt: str, hidden: int) -> Resolved:
    """``cfg`` on a checkpoint declaring ``spec``; ConfigError for a Matryoshka size it does
    not declare (unless forced)."""
    if cfg.dimensions is not None and cfg.dimensions not in spec.matryoshka_dims \
            and not cfg.force_dimensions:
        have = (f"declares the sizes {list(spec.matryoshka_dims)}" if spec.matryoshka_dims
                else "declares no Matryoshka sizes (config.json matryoshka_dims)")
        raise ConfigError(f"--dimensions {cfg.dimensions}: this checkpoint {have}, so its "
                          "first components alone were not trained to work as an embedding; "
                          "--force-dimensions truncates anyway")
    multi = cfg.multi_vector if cfg.multi_vector is not None else (
        spec.multi_vector and cfg.pooling is None and cfg.dimensions is None)
    return Resolved(cfg.pooling or spec.pooling, cfg.dimensions, multi,
                    cfg.prompt or image_prompt, spec, hidden)
