"""``vlmbatch quantize``: calibrate on the user's images and questions, write a W4A16 model.

    quantize_model(model_dir, out_dir, "awq", calib_items, samples=128)

Loads the model into the torch engine (float32 by default, prefix cache off), takes the first
``samples`` questions of the calibration items, runs ``quant.calibrate.quantize_llm`` and
writes the checkpoint with ``quant.checkpoint.save_quantized``. Offline only: serving loads
the result (``engine.loading.load_model``) and never quantises. Here rather than in
``quant/`` because calibration runs the serving engine, which sits above it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from vlmbatch.common.atomic import replaced_on_success
from vlmbatch.engine.config import ConfigError, EngineConfig, ModelConfig
from vlmbatch.engine.loading import read_spec
from vlmbatch.engine.torch_engine import TorchEngine, build_torch_engine
from vlmbatch.models.config_io import ModelError, read_config
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.pipeline.drive import answer_group
from vlmbatch.pipeline.records import ErrorKind, ImageItem
from vlmbatch.quant import GROUP_SIZE, METHODS, SAMPLES
from vlmbatch.quant.calibrate import quantize_llm
from vlmbatch.quant.checkpoint import save_quantized


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    method: str
    samples: int
    linears: int
    report: list[dict]


def calibration_items(items: list[ImageItem], samples: int) -> list[ImageItem]:
    """The first ``samples`` (image, question) pairs, as items."""
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    out, left = [], samples
    for it in items:
        if left <= 0:
            break
        if it.questions:
            out.append(replace(it, questions=it.questions[:left]))
            left -= len(out[-1].questions)
    if not out:
        raise ConfigError("the calibration set has no questions")
    return out


def quantize_model(model: Path | None, out: Path, method: str, items: list[ImageItem],
                   samples: int = SAMPLES, group_size: int = GROUP_SIZE, device: str = "cpu",
                   images_per_batch: int = 16, progress: bool = True,
                   threads: int | None = None) -> QuantizeResult:
    if method not in METHODS:
        raise ConfigError(f"--method {method!r} not one of {METHODS}")
    if group_size < 8 or group_size % 8:
        raise ConfigError(f"--group-size {group_size} must be a positive multiple of 8 "
                          "(e.g. 32, 64, 128)")
    src = Path(model) if model is not None else DEFAULT_MODEL
    if "quantization_config" in read_config(src):
        raise ModelError(f"--model {src} is already quantised (its config.json has a "
                         "quantization_config); quantise the original float checkpoint "
                         "instead")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new folder")
    if out.resolve() == src.resolve():
        raise ConfigError("--out must differ from --model")
    model_spec = read_spec(src)[1]
    if "linear" in model_spec.text.kinds:
        raise ModelError(f"--model {src} ({model_spec.model_type}) has linear-attention (Gated "
                         "DeltaNet) layers: AWQ/GPTQ calibration here covers attention and "
                         "MLP linears only, so W4A16 of this model is not implemented")
    calib = calibration_items(items, samples)
    n = sum(len(it.questions) for it in calib)
    # unfused: calibration hooks the linears by name (q_proj, ...) and writes them so
    engine: TorchEngine = build_torch_engine(ModelConfig(src, device, "float32"),
                                      EngineConfig(vit_backend="torch", prefix_cache=False),
                                      threads, fuse=False)
    llm = engine.model.llm
    spec = llm.spec
    for size in (spec.hidden, spec.intermediate, spec.heads * spec.head_dim):
        if size % group_size:
            raise ConfigError(f"--group-size {group_size} does not divide the language model's "
                              f"input width {size}; choose a divisor (e.g. 32, 64, 128)")

    def run_calibration() -> None:
        for g in range(0, len(calib), images_per_batch):
            answers = answer_group(engine, calib[g: g + images_per_batch])
            failed = [a for a in answers if a.error]
            engine_failed = [a for a in failed if a.error_kind is ErrorKind.ENGINE]
            if engine_failed:
                raise RuntimeError(f"calibration forward failed: {engine_failed[0].error}")
            if len(failed) == len(answers):
                raise ConfigError(f"no calibration image could be read: {failed[0].error}")

    qweights, report = quantize_llm(llm, run_calibration, method, group_size,
                                    progress=progress)
    with replaced_on_success(out) as part:  # an interrupted save leaves no half checkpoint
        save_quantized(src, part, engine.model.family, llm.state_dict(), qweights, group_size,
                       method, n)
    return QuantizeResult(out, method, n, len(qweights), report)
