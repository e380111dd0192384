"""From a checkpoint folder to a ``LoadedModel`` on a device: the model family reads and
builds it (``models/``), then the runtime conversions of ``quant/`` are applied — W4A16
``Int4Linear`` where the checkpoint is packed, torch's dynamic int8 linears for
``--llm-quant int8-dynamic`` (gpt-fast's ``convert_for_runtime``: no loader imports
``quant/``). Also what the engines need around a loaded model: its vision module as a
``VisionModel`` for a runner, and its image plan under the run's options.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from vlmbatch.engine.config import ConfigError, EngineConfig, ModelConfig
from vlmbatch.engine.scoring import choice_ids
from vlmbatch.models.base import ImageOptions, LoadedModel, ModelFamily, ModelSpec
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.io import raw_state_dict
from vlmbatch.models.layers import fuse_projections
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.models.registry import family_for, spec_of
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.preprocessing.resize import resize as resize_with
from vlmbatch.preprocessing.video_plan import VideoPlan, checkpoint_video
from vlmbatch.quant.checkpoint import check_config, int4_weights
from vlmbatch.quant.fp8 import Fp8Unavailable, convert_linears_fp8, require_fp8
from vlmbatch.quant.runtime import QuantError, convert_for_runtime, int8_dynamic
from vlmbatch.vit_trt.base import VisionModel

# ModelConfig.dtype's names (the keys are engine.config.DTYPES: tested) -> torch dtypes
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``ModelConfig.dtype`` name (one of ``DTYPES``)."""
    return TORCH_DTYPES[name]


def check_device(device: str) -> None:
    """Raise ModelError, saying what to do, if torch here cannot use ``device``."""
    d = torch.device(device)
    if d.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("a CPU-only build" if torch.version.cuda is None
               else f"built for CUDA {torch.version.cuda}, but it sees no GPU")
        raise ModelError(f"--device {device}: torch {torch.__version__} here is {why}; use "
                         "--device cpu, or a machine with a GPU and a CUDA build of torch")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ModelError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible "
                         f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")


def read_spec(path: Path | None = None) -> tuple[ModelFamily, ModelSpec]:
    """The checkpoint's family and sizes, without reading its weights (ModelError if it
    cannot be served)."""
    path = Path(path) if path is not None else DEFAULT_MODEL
    family, cfg = family_for(path)
    return family, spec_of(family, path, cfg)


def check_label_sets(path: Path | None, cfg: EngineConfig,
                     label_sets: Iterable[tuple[str, ...]]) -> None:
    """Before any work: ConfigError (``ChoiceError``) for a label set the engine of ``cfg``
    would not score on this checkpoint (two choices it cannot tell apart under
    ``cfg.choice_scoring``, or an engine without label sets). Reads the
    tokenizer, not the weights, and only when there is a label set."""
    sets = sorted(set(label_sets))
    if sets:
        check = label_set_checker(path, cfg)
        for choices in sets:
            check(choices)


def label_set_checker(path: Path | None, cfg: EngineConfig
                      ) -> Callable[[tuple[str, ...]], None]:
    """``check_label_sets`` for one label set at a time, the tokenizer read once (a server's
    HTTP process checks each request's choices with it, its engines elsewhere)."""
    if cfg.engine != "torch":
        raise ConfigError(f"label sets (choices) are scored by the torch engine (--engine "
                          f"torch), not {cfg.engine}")
    family, spec = read_spec(path)
    prompts = family.prompt_builder(
        family.load_tokenizer(Path(path) if path is not None else DEFAULT_MODEL), spec)
    first = cfg.choice_scoring == "first-token"

    def check(choices: tuple[str, ...]) -> None:
        choice_ids(prompts.answer_ids, choices, first)
    return check


def text_tokens(path: Path | None) -> tuple[Callable[[str], int], int]:
    """(the checkpoint's token count of a text, its context in tokens: config.json's
    ``max_position_embeddings``, 0 where it states none), from the tokenizer and config
    alone: what a question's length is checked against before any work. Counts are cached
    by text (a million lines asking one question tokenize it once)."""
    family, spec = read_spec(path)
    tok = family.load_tokenizer(Path(path) if path is not None else DEFAULT_MODEL)

    @functools.lru_cache(maxsize=4096)
    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False, verbose=False))
    return count, int(getattr(spec.text, "max_positions", 0) or 0)


def load_model(path: Path | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, llm_quant: str = "none",
               quant: str = "none", fuse: bool = False) -> LoadedModel:
    """Build our modules from a checkpoint folder (the built-in model by default).

    ``quant="fp8"``: every linear of the decoder (but the LM head) and of the vision encoder
    becomes an ``Fp8Linear`` (``quant/fp8.py``) after loading.

    ``fuse``: the projections that read one input fused into one linear each (q/k/v, gate/up;
    ``models.layers.fuse_projections``), before any quantised conversion, which then
    converts the fused linear whole: a W4A16 checkpoint's parts' int4 rows concatenated
    (``quant.runtime.convert_for_runtime``), FP8 on the fused weight (row-wise scales: the
    same layer). Not with ``int8-dynamic``: torch's dynamic int8 linears keep one scale per
    tensor, which a fused weight would change. The engine fuses (``build_torch_engine``); off by
    default so that the modules keep transformers' layout for whoever reads them by name
    (calibration, the reference tests)."""
    path = Path(path) if path is not None else DEFAULT_MODEL
    check_device(device)
    backend = _fp8_backend(device, quant)
    family, cfg = family_for(path)
    spec = spec_of(family, path, cfg)
    sd = {family.normalise_key(k): t for k, t in raw_state_dict(path).items()}
    int4, group_size = {}, 0
    if (qcfg := cfg.get("quantization_config")) is not None:
        try:
            group_size = check_config(qcfg)
        except ValueError as e:
            raise ModelError(f"{path}: {e}") from e
        int4 = int4_weights(sd, group_size)
    vision, llm = family.build(spec, sd, path)
    llm = llm.to(device, dtype).eval()
    if fuse and llm_quant != "int8-dynamic":
        fuse_projections(llm)
    if int4:
        try:
            convert_for_runtime(llm, int4, group_size, device, dtype, family.llm_param)
        except QuantError as e:
            raise ModelError(f"{path}: {e}") from e
    if llm_quant == "int8-dynamic":
        _check_int8(path, device, dtype, bool(int4))
        llm = int8_dynamic(llm)  # type: ignore[assignment]
    elif llm_quant != "none":
        raise ModelError(f"llm_quant {llm_quant!r} not one of none, int8-dynamic")
    vision = vision.to(device, dtype).eval()
    if fuse:
        fuse_projections(vision)
    if backend is not None:
        if int4:
            raise ModelError(f"{path} is already quantised (W4A16); --quant fp8 needs a float "
                             "model")
        convert_linears_fp8(llm, backend=backend)
        convert_linears_fp8(vision, backend=backend)
    tok = family.load_tokenizer(path)
    return LoadedModel(spec, family, vision, llm, tok, family.prompt_builder(tok, spec))


def _fp8_backend(device: str, quant: str) -> str | None:
    """The FP8 path ``quant`` asks for on ``device`` (None: no FP8); ModelError if none."""
    if quant == "none":
        return None
    if quant != "fp8":
        raise ModelError(f"quant {quant!r} not one of none, fp8")
    try:
        return require_fp8(device)
    except Fp8Unavailable as e:
        raise ModelError(str(e)) from None


def _check_int8(path: Path, device: str, dtype: torch.dtype, packed: bool) -> None:
    if torch.device(device).type != "cpu":
        raise ModelError("llm_quant int8-dynamic runs on the CPU only (torch's dynamic "
                         "int8 linears); use a W4A16 checkpoint on CUDA")
    if packed:
        raise ModelError(f"{path} is already quantised; int8-dynamic needs a float model")
    if dtype != torch.float32:
        raise ModelError(f"llm_quant int8-dynamic takes float32 activations (torch's "
                         f"dynamic int8 linears), not {str(dtype).removeprefix('torch.')}; "
                         "drop --dtype or use --dtype float32")


def image_plan_for(family: ModelFamily, spec: ModelSpec, cfg: ModelConfig) -> ImagePlan:
    """The checkpoint's image plan under the run's ``--tiling``/``--resize``/... options."""
    try:
        return family.image_plan(spec, ImageOptions(cfg.tiling, cfg.max_tiles,
                                                    cfg.upscale_limit, cfg.max_image_tokens,
                                                    cfg.resize))
    except ValueError as e:
        raise ConfigError(str(e)) from None


# model_type -> the video processor family whose sampling and rows it uses
_VIDEO_FAMILY = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl",
                 "qwen3_5": "qwen3_vl", "internvl": "internvl", "internvl_chat": "internvl"}


def video_plan_for(spec: ModelSpec, kernel: str = "opencv") -> VideoPlan | None:
    """The checkpoint's clip plan (``preprocessing/video_plan.py``, read as transformers
    reads its video processor), None for a family that takes no clips; it knows InternVL's
    tokens per frame and the model's context (``preprocessing/video_budget.py``). ``kernel``:
    the image plan's resize kernel (``--resize``), which frames are resized with too: under
    ``reference`` each family's video processor resizes as its image processor does
    (torchvision's antialiased bicubic; Pillow's for the original InternVL layout, whose
    model card tiles each frame as an image)."""
    family = _VIDEO_FAMILY.get(getattr(spec, "model_type", ""))
    if family is None:
        return None
    plan = checkpoint_video(spec.path, family)  # with what its token limits need to know
    resize = None if kernel == "opencv" else functools.partial(resize_with, kernel=kernel)
    return dataclasses.replace(plan, frame_tokens=int(getattr(spec, "tokens_per_tile", 0)),
                               context=int(getattr(spec.text, "max_positions", 0) or 0),
                               resize=resize)


def vision_model(model: LoadedModel) -> VisionModel:
    """The loaded model's vision module with its shapes, for a vision runner."""
    f, spec = model.family, model.spec
    return VisionModel(model.vision, f.vision_input_shape(spec), f.vision_output_shape(spec),
                       spec.path, packed=f.packed_vision,
                       budget=f.budget_forward(spec))
