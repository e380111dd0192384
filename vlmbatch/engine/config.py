"""The engine side of the one frozen config tree: ``ModelConfig`` (which checkpoint, where,
how its images are prepared), ``EngineConfig`` (how it is run) and ``EmbedConfig`` (how
inputs become vectors). ``jobs.config.RunConfig`` holds them, with the run's input, output
and executor; every command's root holds the ones it uses.

Validation lives in ``__post_init__`` so a bad value fails before any model is loaded. Each
field a user sets from the command line declares its option in its metadata
(``common/options.py``: flags, help, metavar, how the text becomes the value); the parsers
of every command are derived from those declarations (``cli/args.py``), so an option, its
default and its choices are written once, here.

Light by design (``--help`` and ``status`` import it): no torch, no model or runner code. The
dtype and the device are names, checked here as strings (``DTYPES``; ``cpu``, ``cuda``,
``cuda:N`` as ``torch.device`` reads them) and resolved where the model is loaded
(``engine/loading.py``); choice lists come from registry names and light constants.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from vlmbatch.common.options import COUNT, MIB, WORDS, N, opt
from vlmbatch.common.registry import Registry
from vlmbatch.models.embedding import POOLINGS, EmbeddingSpec
from vlmbatch.models.paths import DEFAULT_EMBED_MODEL, DEFAULT_MODEL
from vlmbatch.preprocessing.tiling import RESIZE_MODES, TILING_MODES
from vlmbatch.vit_trt import RUNNERS

# the engines by name, each builder as "module:attr" (engine/build.py builds them): listing
# the names (``--engine``'s choices) imports none of them. A builder takes
# (ModelConfig, EngineConfig, threads) and returns an ``engine.base.Engine``.
ENGINES: Registry[Any] = Registry("engine", {
    "torch": "vlmbatch.engine.torch_engine:build_torch_engine",  # ours: CPU and CUDA
    "lmdeploy": "vlmbatch.engine.lmdeploy_engine:build_lmdeploy",  # TurboMind, GPU env only
})


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
# what --dtype takes: a name, or "auto" (``resolve_dtype``: the fastest safe one here)
DTYPE_CHOICES = ("auto", *DTYPES)
# CPU flags (/proc/cpuinfo) of a bf16 matrix unit: AVX512-BF16's dot products or AMX tiles.
# bf16 vs float32 there, and its easy-vqa accuracy: docs/figures.md#dtype-on-the-cpu
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# set, what "auto" resolves to on this machine whatever its device and CPU (the test suite
# sets float32: results then do not depend on the CPU the suite runs on)
AUTO_DTYPE_ENV = "VLMBATCH_AUTO_DTYPE"
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


def model_shown(path: Path | None) -> str:
    """``--model``'s default as its help reads it."""
    if path is None or Path(path) == DEFAULT_MODEL:
        return "the built-in model"
    return "the built-in embedding model" if Path(path) == DEFAULT_EMBED_MODEL else str(path)


@dataclass(frozen=True)
class ModelConfig:
    OPTION_GROUP: ClassVar[str] = "model"
    path: Path | None = field(default=None, metadata=opt(  # None: the built-in model
        "--model", parse=Path, metavar="DIR", show=model_shown,
        help="HF-format checkpoint folder, e.g. an InternVL '-hf' release; nothing is "
        "downloaded (default: %(default)s)"))
    device: str = field(default="cpu", metadata=opt(
        "--device", metavar="DEVICE", help="torch device: cpu, cuda or cuda:N (default "
        "%(default)s)"))
    # one of DTYPE_CHOICES; "auto" resolves where the model loads (``resolved_dtype``)
    dtype: str = field(default="auto", metadata=opt(
        "--dtype", choices=DTYPE_CHOICES, help="weights and activations (default %(default)s: "
        "bfloat16 on CUDA and on CPUs with a bf16 unit (avx512_bf16 or amx_bf16), else "
        "float32; float32 for results identical to transformers' float32, docs/run.md)"))
    max_tiles: int | None = field(default=None, metadata=opt(  # the checkpoint's cap, overridden
        "--max-tiles", unit=COUNT, help="cap tiles per image (default: the checkpoint's "
        "max_patches)"))
    # "reduced" (fewest tiles that keep the image's resolution, letterboxed; the default since
    # the built-in model trains on it too) | "reference" (InternVL's dynamic_preprocess)
    tiling: str = field(default="reduced", metadata=opt(
        "--tiling", choices=TILING_MODES, help="reduced (default): fewest tiles that keep the "
        "image's resolution, letterboxed (docs/preprocessing.md); reference: InternVL's "
        "dynamic_preprocess, for parity with the model card"))
    # "opencv" (our INTER_AREA/INTER_CUBIC policy) | "reference" (the pixels of the family's
    # transformers image processor, for parity with a transformers or vLLM pipeline) |
    # "pillow" (transformers' pil-backend processors, its choice without torchvision)
    resize: str = field(default="opencv", metadata=opt(
        "--resize", choices=RESIZE_MODES, help="opencv (default): INTER_AREA when shrinking, "
        "INTER_CUBIC when enlarging; reference: the pixels of the family's transformers image "
        "processor (torchvision's or Pillow's bicubic, as it uses; vLLM's), to reproduce a "
        "transformers or vLLM pipeline's P(yes) exactly; pillow: Pillow's bicubic, as "
        "transformers' processors without torchvision (docs/preprocessing.md#resize-modes)"))
    upscale_limit: float = field(default=1.0, metadata=opt(
        "--upscale-limit", parse=float, metavar="FACTOR", help="reduced tiling: most a tile "
        "count may enlarge an image (default %(default)s)"))
    max_image_tokens: int | None = field(default=None, metadata=opt(  # thumbnail included
        "--max-image-tokens", unit=COUNT, metavar="TOKENS", help="per-image token budget the "
        "tiling must fit (thumbnail included)"))
    llm_quant: str = field(default="none", metadata=opt(  # W4A16 comes from the checkpoint
        "--llm-quant", choices=LLM_QUANT, help="int8-dynamic: torch dynamic int8 linears for "
        "the language model (CPU). For W4A16 pass a checkpoint made by `vlmbatch quantize`"))
    # "fp8": e4m3 W8A8 linears (decoder and vision encoder) through torch._scaled_mm on CUDA
    # (compute capability >= 8.9); on the CPU a slow reference of the same arithmetic
    quant: str = field(default="none", metadata=opt(
        "--quant", choices=QUANT, help="fp8: e4m3 W8A8 linears in the decoder and the vision "
        "encoder (torch._scaled_mm; CUDA compute capability >= 8.9; on the CPU a slow "
        "reference of the same arithmetic, for accuracy checks)"))

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
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype {self.dtype!r} not one of {list(DTYPE_CHOICES)}")
        if self.max_tiles is not None and self.max_tiles < 1:
            raise ConfigError(f"max_tiles must be >= 1, got {self.max_tiles}")
        if self.tiling not in TILING_MODES:
            raise ConfigError(f"tiling {self.tiling!r} not one of {TILING_MODES}")
        if self.resize not in RESIZE_MODES:
            raise ConfigError(f"resize {self.resize!r} not one of {RESIZE_MODES}")
        if self.max_image_tokens is not None and self.max_image_tokens < 1:
            raise ConfigError(f"max_image_tokens must be >= 1, got {self.max_image_tokens}")
        if not self.upscale_limit > 0:
            raise ConfigError(f"upscale_limit must be > 0, got {self.upscale_limit}")

    @property
    def model_dir(self) -> Path:
        return self.path if self.path is not None else DEFAULT_MODEL

    @property
    def resolved_dtype(self) -> str:
        """The dtype the model loads in: ``dtype``, with "auto" resolved for this machine."""
        return resolve_dtype(self.dtype, self.device, self.llm_quant)

    def dtype_note(self) -> str:
        """What a run summary says of the dtype: ``dtype bfloat16 (auto)``."""
        return f"dtype {self.resolved_dtype}" + (" (auto)" if self.dtype == "auto" else "")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (the ``flags`` line of /proc/cpuinfo; none where there is
    no such file, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def resolve_dtype(dtype: str, device: str, llm_quant: str = "none",
                  flags: frozenset[str] | None = None) -> str:
    """The one place ``--dtype auto`` is decided: bfloat16 on CUDA, and on a CPU with a bf16
    matrix unit (``BF16_CPU_FLAGS`` among ``flags``, by default this CPU's) (measured faster
    there for both built-in models and the InternVL3-1B topology); float32 elsewhere, and with
    ``--llm-quant int8-dynamic`` (float32 linears); ``$VLMBATCH_AUTO_DTYPE`` where set. Any
    other name is returned as it is."""
    if dtype != "auto":
        return dtype
    pinned = os.environ.get(AUTO_DTYPE_ENV)
    if pinned:
        if pinned not in DTYPES:
            raise ConfigError(f"${AUTO_DTYPE_ENV}={pinned!r} is not one of {list(DTYPES)}; "
                              "unset it or name a dtype")
        return pinned
    if device.startswith("cuda"):
        return "bfloat16"
    if llm_quant != "none":
        return "float32"
    has_unit = (cpu_flags() if flags is None else flags) & BF16_CPU_FLAGS
    return "bfloat16" if has_unit else "float32"


@dataclass(frozen=True)
class EngineConfig:
    OPTION_GROUP: ClassVar[str] = "engine"
    # the fields that matter only when questions are answered (``embed`` does not take them)
    ANSWER_ONLY: ClassVar[tuple[str, ...]] = ("max_new_tokens", "ignore_eos", "yes_words",
                                              "no_words", "choice_scoring",
                                              "question_rows")
    # one of ENGINES (checked when built): torch (ours, CPU/CUDA), lmdeploy
    engine: str = field(default="torch", metadata=opt(
        "--engine", choices=tuple(ENGINES.names()), help="torch: ours (CPU/CUDA, default); "
        "lmdeploy: TurboMind, GPU env only, never run by us yet"))
    vit_backend: str = field(default="auto", metadata=opt(  # one of vit_backends()
        "--vit-backend", choices=vit_backends(), help="vision encoder runner (default auto: "
        "tensorrt on CUDA when installed, else torch); onnxruntime-int8: dynamic int8 ViT on "
        "CPU"))
    # torch/tensorrt vision backends on CUDA: batch-bucketed graph pool
    cuda_graphs: bool = field(default=True, metadata=opt(
        "--no-cuda-graphs", action="false", help="torch/tensorrt vision backends on CUDA: run "
        "without the CUDA graph pool"))
    max_batch_tokens: int = field(default=8192, metadata=opt(  # padded prompt tokens per forward
        "--max-batch-tokens", unit=COUNT, metavar="TOKENS", help="padded prompt tokens per LLM "
        "forward (default %(default)s)"))
    max_batch_tiles: int = field(default=64, metadata=opt(  # tiles per vision-encoder forward
        "--max-batch-tiles", unit=N, help="tiles per vision-encoder forward (default "
        "%(default)s)"))
    # largest vision batch a runner prepares for: the graph pool's largest bucket, the
    # TensorRT profile's maximum; larger forwards are split
    vit_max_batch: int = field(default=32, metadata=opt(
        "--vit-max-batch", unit=N, help="largest vision batch prepared for: the CUDA graph "
        "pool's largest bucket and the TensorRT profile's maximum (default %(default)s)"))
    # the decoder's prefill through torch.compile (dynamic shapes); off by default: its gain
    # on a GPU has not been measured yet (bench/qpm.py --compile-llm, bench/gpu_check.sh)
    compile_llm: bool = field(default=False, metadata=opt(
        "--compile-llm", action="true", help="run the language model's prefill through "
        "torch.compile (dynamic shapes; the first batches pay the compilation)"))
    # image-aware prefix KV cache (engine/prefix_cache.py)
    prefix_cache: bool = field(default=True, metadata=opt(
        "--no-prefix-cache", action="false", group="prefix cache",
        help="recompute every prompt's image tokens (for comparison)"))
    block_size: int = field(default=16, metadata=opt(  # tokens per cache block
        "--block-size", unit=COUNT, metavar="TOKENS", group="prefix cache",
        help="tokens per cache block (default %(default)s)"))
    cache_bytes: int = field(default=1 << 30, metadata=opt(  # LRU budget for cached KV
        "--cache-mib", unit=MIB, group="prefix cache", help="KV cache budget in MiB: one pool "
        "of this size (on CUDA taken when the engine starts), least recently used blocks "
        "evicted first (default %(default)s)"))
    # > 0: also generate a greedy text answer of up to this length
    max_new_tokens: int = field(default=0, metadata=opt(
        "--max-new-tokens", parse=int, metavar="N", help="also write a greedy text answer of "
        "up to N tokens (default 0: none); a question's own max_new_tokens (policy/manifest) "
        "overrides it"))
    # generate exactly max_new_tokens (benchmarks of long answers)
    ignore_eos: bool = field(default=False, metadata=opt(
        "--ignore-eos", action="true", help="with --max-new-tokens: always generate N tokens "
        "(for benchmarks)"))
    # Words that are not one token of the model's vocabulary are skipped (是/否 are single
    # tokens in Qwen2's vocabulary, not in the built-in model's).
    yes_words: tuple[str, ...] = field(default=("yes", "Yes", "YES", "是"), metadata=opt(
        "--yes", unit=WORDS, help="comma-separated answer words counted as yes; P(yes) sums "
        "their first-token probabilities (default %(default)s)"))
    no_words: tuple[str, ...] = field(default=("no", "No", "NO", "否"), metadata=opt(
        "--no", unit=WORDS, help="comma-separated answer words counted as no (default "
        "%(default)s)"))
    choice_scoring: str = field(default="exact", metadata=opt(  # one of CHOICE_SCORING
        "--choice-scoring", choices=CHOICE_SCORING, help="label-set questions (choices): exact "
        "(default) scores each choice's whole token sequence after the prompt, sum of log "
        "P(token | prompt, the choice's tokens before it), in one continuation forward after "
        "the prompt's KV; first-token scores its first token only (cheaper; refused, naming "
        "them, when two choices start with the same token)"))
    # an image's prefix and its yes/no questions in one row, one forward (engine/packing.py):
    # "auto" where the host is the bottleneck (CUDA), else the leaders/followers phases,
    # which compute less (the CPU is bound by arithmetic: docs/engine.md, "Host cost")
    question_rows: str = field(default="auto", metadata=opt(  # one of QUESTION_ROWS
        "--question-rows", choices=QUESTION_ROWS, help="with the prefix cache: on puts an "
        "image's prefix and its yes/no questions in one row, one forward for them all (fewer "
        "forwards and host work; more arithmetic); off prefills the prefix first, then the "
        "questions after it; auto (default): on with CUDA, off on the CPU"))

    def __post_init__(self) -> None:
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
        if self.question_rows not in QUESTION_ROWS:
            raise ConfigError(f"question_rows {self.question_rows!r} not one of "
                              f"{QUESTION_ROWS}")


@dataclass(frozen=True)
class EmbedConfig:
    """How inputs become vectors (``engine/embed.py``); checked against the checkpoint's
    declarations (``models/embedding.py``) when an embedder is built."""
    OPTION_GROUP: ClassVar[str] = "embeddings"
    # one of POOLINGS; None: the checkpoint's, else its family's
    pooling: str | None = field(default=None, metadata=opt(
        "--pooling", choices=POOLINGS, help="image-mean: an image's hidden states over "
        "<img>..</img>, a text's over its tokens (jina-embeddings-v4); mean: every token; "
        "last: the last token (GME/VLM2Vec). Default: the checkpoint's, else its family's"))
    dimensions: int | None = field(default=None, metadata=opt(  # Matryoshka: the first N
        "--dimensions", unit=COUNT, help="Matryoshka: keep the first N components, re-normalised "
        "(N must be one of the checkpoint's matryoshka_dims)"))
    force_dimensions: bool = field(default=False, metadata=opt(  # where none is declared
        "--force-dimensions", action="true", help="--dimensions even where the checkpoint "
        "declares no such size"))
    # one unit vector per token (after the checkpoint's projection); None: the checkpoint's
    # default (ColQwen2: yes, unless --pooling or --dimensions asks for a pooled vector)
    multi_vector: bool | None = field(default=None, metadata=opt(
        "--multi-vector", action="both", help="one unit vector per token (after the "
        "checkpoint's projection layer); default: the checkpoint's (a ColQwen2 one: yes, "
        "unless --pooling or --dimensions is given)"))
    prompt: str | None = field(default=None, metadata=opt(  # None: the family's
        "--prompt", metavar="TEXT", help="text after the image of an image-only input "
        "(default: the family's, 'Describe the image.')"))
    query_prefix: str = field(default="", metadata=opt(  # before a text-only input, as given
        "--query-prefix", metavar="TEXT", help="put before every text-only input, as given "
        "(e.g. 'Query: ')"))
    document_prefix: str = field(default="", metadata=opt(  # before an input with an image
        "--document-prefix", metavar="TEXT", help="put before the text of inputs with an "
        "image, and of --maxsim DOCS"))

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
