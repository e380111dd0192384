"""W4A16 checkpoints in compressed-tensors' ``pack-quantized`` format, written and read.

Writing (``save_quantized``): the source directory's files are copied, except its weights;
the new ``model.safetensors`` keeps every vision/projector tensor as it was (same key names)
and, for the language model, the current (possibly AWQ-rescaled) full-precision tensors plus,
for each quantised linear ``P``, ``P.weight_packed`` (int32 ``[N, K/8]``), ``P.weight_scale``
(``[N, K/group]``, the source dtype) and ``P.weight_shape`` (int64 ``[2]``) instead of
``P.weight``. ``config.json`` gains ``quantization_config`` (``quant_method:
compressed-tensors``, ``format: pack-quantized``, one symmetric 4-bit group scheme over the
language model's decoder linears; the vision tower, projector and ``lm_head`` are ignored),
the block vLLM and LMDeploy read. That those engines load our files is not yet checked.

Reading (``int4_weights``): from a state dict with normalised keys, the ``(q, scale)`` of each
packed linear, and the dequantised ``.weight`` put back so the ordinary loader can run; the
loader (``engine/loading.py``) then swaps those linears for ``quant.int4.Int4Linear`` with
``quant.runtime.convert_for_runtime``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlmbatch.models.base import ModelFamily
from vlmbatch.models.io import raw_state_dict
from vlmbatch.quant.int4 import dequantize, pack_int32, unpack_int32

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


def quantization_config(group_size: int, method: str, samples: int) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group_size, "dynamic": False, "actorder": None,
                        "observer": "minmax"},
            "input_activations": None, "output_activations": None,
            "format": "pack-quantized"}},
        "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*",
                   "re:.*visual.*"],  # InternVL's vision and projector; Qwen-VL's tower
        "kv_cache_scheme": None,
        "vlmbatch": {"method": method, "calibration_samples": samples},
    }


def save_quantized(src: Path, out: Path, family: ModelFamily,
                   llm_state: dict[str, torch.Tensor],
                   qweights: dict[str, tuple[torch.Tensor, torch.Tensor]], group_size: int,
                   method: str, samples: int) -> Path:
    """Write the quantised checkpoint to ``out``.

    llm_state: our language-model state dict (names like ``layers.0.self_attn.q_proj.
    weight``, mapped to weight keys by ``family.llm_key``); qweights:
    ``{"layers.0.self_attn.q_proj": (q, scale)}``. Language-model tensors keep the key
    spelling of the source files (read once, here; ``family`` normalises them).
    """
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    source = raw_state_dict(src)
    raw_key_of = {family.normalise_key(k): k for k in source}
    for raw, t in source.items():
        if not family.is_llm_key(family.normalise_key(raw)):
            tensors[raw] = t
    del source
    dtype = next(iter(llm_state.values())).dtype
    for name, t in llm_state.items():
        key = family.llm_key(name)
        if key == "lm_head.weight" and "lm_head.weight" not in raw_key_of:
            continue  # tied to the embeddings
        raw = raw_key_of.get(key, "model." + key)
        lin = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and lin in qweights:
            q, scale = qweights[lin]
            base = raw[: -len("weight")]
            tensors[base + "weight_packed"] = pack_int32(q).contiguous()
            tensors[base + "weight_scale"] = scale.to(dtype).contiguous()
            tensors[base + "weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        else:
            tensors[raw] = t.detach().cpu().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(group_size, method, samples)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def check_config(cfg: dict) -> int:
    """The group size of a ``quantization_config`` we can serve; ValueError naming what not."""
    if cfg.get("quant_method") != "compressed-tensors" or cfg.get("format") != "pack-quantized":
        raise ValueError(f"quantization_config quant_method={cfg.get('quant_method')!r} "
                         f"format={cfg.get('format')!r}: only compressed-tensors "
                         "pack-quantized (W4A16) checkpoints are supported")
    groups = list(cfg.get("config_groups", {}).values())
    if len(groups) != 1:
        raise ValueError(f"quantization_config has {len(groups)} config groups; expected one")
    w = groups[0].get("weights") or {}
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
    # act-order "static" (llm-compressor's GPTQ default) quantises columns in activation order
    # but keeps groups contiguous, so the stored tensors are the plain layout; "group" and
    # "weight" store a column permutation (g_idx) that we do not apply.
    if w.get("actorder") not in (None, False, "static") or bad:
        raise ValueError(f"unsupported weight scheme {bad or {'actorder': w.get('actorder')}}: "
                         "only symmetric 4-bit group quantisation (act-order none or static) "
                         "is served")
    return int(w["group_size"])


def int4_weights(sd: dict[str, torch.Tensor], group_size: int
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pop the packed tensors of ``sd`` (normalised keys); put back each dequantised
    ``.weight``. Returns ``{normalised weight key: (q int8 [N, K], scale [N, G])}``."""
    found = {}
    for key in [k for k in sd if k.endswith(".weight_packed")]:
        base = key[: -len("weight_packed")]
        packed = sd.pop(key)
        scale = sd.pop(base + "weight_scale")
        n, k = (int(v) for v in sd.pop(base + "weight_shape").tolist())
        q = unpack_int32(packed, k)[:n]
        found[base + "weight"] = (q, scale.float())
        sd[base + "weight"] = dequantize(q, scale, group_size, scale.dtype)
    return found
