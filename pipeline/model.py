"""Load an HF-native InternVL directory into our modules: vision encoder, Qwen2 LM, tokenizer.

A model directory holds ``config.json`` (``model_type: internvl``), ``model.safetensors`` or a
sharded ``model.safetensors.index.json``, the tokenizer files and optionally
``preprocessor_config.json`` (tile size, min/max tiles, mean/std). transformers is used only
to read the tokenizer; the weights go straight from safetensors into our modules.

Key layouts accepted: what transformers 5 saves (``vision_tower.*``,
``language_model.model.*``), the 4.5x hub layout (``model.vision_tower.*``,
``model.language_model.*``, ``lm_head.*``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pipeline.llm import Qwen2LM, TextSpec
from preprocessing.prepare import TilingConfig
from vit_trt.encoder import VisionEncoder, VisionSpec

DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ModelError(RuntimeError):
    """The model directory is missing, incomplete or of an unsupported kind."""


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    vision: VisionSpec
    text: TextSpec
    tiling: TilingConfig
    image_token_id: int

    @property
    def tokens_per_tile(self) -> int:
        return self.vision.tokens_per_tile(self.tiling.tile_size)


@dataclass
class LoadedModel:
    spec: ModelSpec
    vision: VisionEncoder
    llm: Qwen2LM
    tokenizer: Any  # a transformers tokenizer


def _pair(v: int | list[int]) -> int:
    if isinstance(v, (list, tuple)):
        if v[0] != v[1]:
            raise ModelError(f"non-square image/patch size {v} is not supported")
        return int(v[0])
    return int(v)


def read_config(path: Path) -> dict:
    """The model directory's ``config.json``; ModelError, saying what to do, if absent."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(
            f"no model at {path}: looked for {cfg_file}. Pass --model DIR with an HF-format "
            "InternVL checkpoint (config.json, *.safetensors, tokenizer files), or leave "
            "--model out to use the built-in model.")
    return _read_json(cfg_file)


def read_spec(path: Path) -> ModelSpec:
    cfg_file = path / "config.json"
    cfg = read_config(path)
    if cfg.get("model_type") != "internvl":
        raise ModelError(f"{cfg_file}: model_type {cfg.get('model_type')!r} is not supported; "
                         "vlmbatch reads HF-native InternVL checkpoints (model_type 'internvl', "
                         "e.g. the '-hf' InternVL2.5/3 releases).")
    v, t = cfg["vision_config"], cfg["text_config"]
    if t.get("model_type", "qwen2") != "qwen2":
        raise ModelError(f"{cfg_file}: text model {t.get('model_type')!r} is not supported yet "
                         "(only qwen2)")
    rope = t.get("rope_parameters") or {"rope_type": "default",
                                        "rope_theta": t.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ModelError(f"{cfg_file}: rope_type {rope['rope_type']!r} is not supported yet")
    pre = _read_json(path / "preprocessor_config.json")
    size = pre.get("size", {}).get("height") or _pair(v.get("image_size", 448))
    tiling = TilingConfig(tile_size=int(size), min_tiles=int(pre.get("min_patches", 1)),
                          max_tiles=int(pre.get("max_patches", 12)), use_thumbnail=True)
    text_hidden = int(t["hidden_size"])
    vision = VisionSpec(
        hidden=v["hidden_size"], layers=v["num_hidden_layers"], heads=v["num_attention_heads"],
        intermediate=v["intermediate_size"], patch=_pair(v.get("patch_size", 14)),
        image_size=_pair(v.get("image_size", 448)), norm_type=v.get("norm_type", "layer_norm"),
        eps=float(v.get("layer_norm_eps", 1e-6)), qk_norm=bool(v.get("use_qk_norm", False)),
        act=v.get("hidden_act", "gelu"), mean_pooling=bool(v.get("use_mean_pooling", True)),
        feature_layer=int(cfg.get("vision_feature_layer", -1)),
        drop_cls=cfg.get("vision_feature_select_strategy", "default") == "default",
        downsample=float(cfg.get("downsample_ratio", 0.5)),
        projector_act=cfg.get("projector_hidden_act", "gelu"), text_hidden=text_hidden,
        mean=tuple(pre.get("image_mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
        std=tuple(pre.get("image_std", IMAGENET_STD)))  # type: ignore[arg-type]
    text = TextSpec(
        vocab=t["vocab_size"], hidden=text_hidden, layers=t["num_hidden_layers"],
        heads=t["num_attention_heads"], kv_heads=t.get("num_key_value_heads") or
        t["num_attention_heads"], intermediate=t["intermediate_size"],
        eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))))
    return ModelSpec(path, vision, text, tiling, int(cfg.get("image_token_id", 151667)))


def _read_json(p: Path) -> dict:
    """``p`` as a dict, ``{}`` if absent; ModelError naming the file if it is not a JSON object."""
    if not p.is_file():
        return {}
    try:
        d = json.loads(p.read_text())
    except ValueError as e:  # JSONDecodeError; UnicodeDecodeError for a binary file
        raise ModelError(f"{p} is not valid JSON ({e}); restore it from the original "
                         "checkpoint") from e
    if not isinstance(d, dict):
        raise ModelError(f"{p} is not a JSON object; restore it from the original checkpoint")
    return d


def raw_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, keys as its files spell them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(path / f)))
        except SafetensorError as e:
            raise ModelError(f"{path / f} cannot be read ({e}): the file is truncated or "
                             "corrupt; copy or download it again") from e
    return sd


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, keys normalised (see module docstring)."""
    return {normalise_key(k): t for k, t in raw_state_dict(path).items()}


def normalise_key(k: str) -> str:
    """Any accepted key spelling -> ``vision_tower.*``, ``multi_modal_projector.*``,
    ``language_model.*`` (decoder, no ``model.``) or ``lm_head.weight``."""
    if k.startswith("model."):
        k = k[len("model."):]
    if k.startswith("language_model.model."):
        k = "language_model." + k[len("language_model.model."):]
    if k == "language_model.lm_head.weight":
        k = "lm_head.weight"
    return k


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


def load_model(path: Path | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, llm_quant: str = "none") -> LoadedModel:
    """Build our modules from an HF InternVL directory (the built-in model by default).

    A W4A16 checkpoint (``quantization_config``, see ``quant/checkpoint.py``) gets
    ``Int4Linear`` decoder linears; ``llm_quant="int8-dynamic"`` (CPU) swaps the language
    model's linears for torch's dynamically quantised int8 ones after loading.
    """
    path = Path(path) if path is not None else DEFAULT_MODEL
    check_device(device)
    spec = read_spec(path)
    sd = read_state_dict(path)
    qcfg = _read_json(path / "config.json").get("quantization_config")
    int4 = {}
    if qcfg is not None:
        from quant.checkpoint import check_config, int4_weights

        try:
            group_size = check_config(qcfg)
        except ValueError as e:
            raise ModelError(f"{path}: {e}") from e
        int4 = int4_weights(sd, group_size)
    vision = VisionEncoder(spec.vision)
    _load_weights(vision, sd, path)
    llm = Qwen2LM(spec.text)
    _load_weights(llm, sd, path)
    llm = llm.to(device, dtype).eval()
    if int4:
        from quant.int4 import Int4Linear

        for key, (q, scale) in int4.items():
            parent, name = _module_of(llm, key)
            old = getattr(parent, name)
            setattr(parent, name, Int4Linear(q, scale, old.bias, group_size, device, dtype))
    if llm_quant == "int8-dynamic":
        if torch.device(device).type != "cpu":
            raise ModelError("llm_quant int8-dynamic runs on the CPU only (torch's dynamic "
                             "int8 linears); use a W4A16 checkpoint on CUDA")
        if int4:
            raise ModelError(f"{path} is already quantised; int8-dynamic needs a float model")
        if dtype != torch.float32:
            raise ModelError(f"llm_quant int8-dynamic takes float32 activations (torch's "
                             f"dynamic int8 linears), not {str(dtype).removeprefix('torch.')}; "
                             "drop --dtype or use --dtype float32")
        llm = torch.ao.quantization.quantize_dynamic(llm, {torch.nn.Linear}, dtype=torch.qint8)
    elif llm_quant != "none":
        raise ModelError(f"llm_quant {llm_quant!r} not one of none, int8-dynamic")
    tok = load_tokenizer(path)
    return LoadedModel(spec, vision.to(device, dtype).eval(), llm, tok)


class _ReadLog(dict):
    """A state dict that remembers the last key read."""
    last: str | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        self.last = key
        return super().__getitem__(key)


def _load_weights(module: VisionEncoder | Qwen2LM, sd: dict[str, torch.Tensor],
                  path: Path) -> None:
    """``module.load_hf(sd)``; ModelError naming the weight if config.json does not fit it."""
    log = _ReadLog(sd)
    try:
        module.load_hf(log)
    except KeyError as e:  # weights the config asks for are not in the checkpoint
        raise ModelError(f"{path}: {e.args[0]}; config.json and the weights must come from "
                         "the same checkpoint: restore its original config.json") from e
    except RuntimeError as e:  # copy_ of a tensor of another shape (not, e.g., out of memory)
        if log.last is None or "size" not in str(e) and "shape" not in str(e):
            raise
        raise ModelError(f"{path}: weight {log.last} has shape {tuple(sd[log.last].shape)}, "
                         f"which the sizes in config.json do not fit ({e}); config.json and "
                         "the weights must come from the same checkpoint: restore its original "
                         "config.json") from e


def _module_of(llm: Qwen2LM, key: str) -> tuple[torch.nn.Module, str]:
    """``language_model.layers.0.self_attn.q_proj.weight`` -> (our layer 0, "q_proj")."""
    parts = key.split(".")
    if parts[:2] != ["language_model", "layers"] or parts[-1] != "weight":
        raise ModelError(f"quantised tensor {key} is not a decoder-layer linear")
    layer = llm.layers[int(parts[2])]
    name = parts[-2]
    if not isinstance(getattr(layer, name, None), torch.nn.Linear):
        raise ModelError(f"quantised tensor {key}: no linear {name!r} in our decoder layer")
    return layer, name


def load_tokenizer(path: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
        raise ModelError(f"cannot load the tokenizer from {path}: {e}") from e
    missing = [a for a in ("start_image_token", "context_image_token", "end_image_token")
               if getattr(tok, a, None) is None
               or tok.convert_tokens_to_ids(getattr(tok, a)) in (None, tok.unk_token_id)]
    if missing:
        raise ModelError(f"the tokenizer in {path} lacks InternVL's image tokens "
                         f"({', '.join(missing)}); copy the checkpoint's tokenizer files "
                         "(tokenizer.json, tokenizer_config.json) into the folder")
    if getattr(tok, "chat_template", None) is None:
        raise ModelError(f"the tokenizer in {path} has no chat template; copy the checkpoint's "
                         "chat_template.jinja (or tokenizer_config.json) into the folder")
    return tok
