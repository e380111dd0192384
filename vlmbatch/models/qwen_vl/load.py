"""Load a Qwen-VL checkpoint directory into our modules (no transformers involved).

The directory holds ``config.json``, optionally ``preprocessor_config.json``, and
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Key layouts
accepted are those of ``VisionTower.load_hf`` and the family's ``normalise_key`` (the decoder
reads normalised keys, ``TextDecoder.load_hf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlmbatch.models.decoder import TextDecoder
from vlmbatch.models.io import raw_state_dict
from vlmbatch.models.qwen_vl.family import QwenVL
from vlmbatch.models.qwen_vl.spec import QwenVLSpec, read_qwen_vl_spec
from vlmbatch.models.qwen_vl.vision import VisionTower


@dataclass
class QwenVLModel:
    spec: QwenVLSpec
    vision: VisionTower
    text: TextDecoder


def load_qwen_vl(path: Path | str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> QwenVLModel:
    """Spec, vision tower and decoder of the checkpoint at ``path``, in eval mode."""
    path = Path(path)
    spec = read_qwen_vl_spec(path)
    sd = raw_state_dict(path)  # the one reader of weights (models/io.py)
    vision, text = VisionTower(spec.vision), TextDecoder(spec.text)
    vision.load_hf(sd)
    text.load_hf({QwenVL().normalise_key(k): t for k, t in sd.items()})
    return QwenVLModel(spec, vision.to(device, dtype).eval(), text.to(device, dtype).eval())
