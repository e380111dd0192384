"""Random InternVL checkpoints in the original layout beside their HF-native twins, built by
the tests (``tests/models/random_original.py``: the twin's weights under the original
names), and the modules of a checkpoint without its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import TEXT_MODELS, make_model_dir
from tests.models.random_original import save_original, save_sentencepiece_tokenizer
from vlmbatch.models.internvl.random import save_random_internvl
from vlmbatch.models.io import raw_state_dict
from vlmbatch.models.registry import family_for


@dataclass(frozen=True)
class Kind:
    arch: str  # llm_config.architectures[0]
    template: str
    text: dict  # the twin's text-config keywords (tests/conftest.py)
    vision: dict  # make_model_dir's vision keywords


# every text model and both InternViT variants: the 300M (layer norm, q/k/v biases) and the
# 6B's (RMS norm, QK-norm over the whole width, no q/k/v biases)
KINDS = {
    "internvl2_5_qwen2": Kind("Qwen2ForCausalLM", "internvl2_5", {}, {}),
    "internvl3_5_qwen3": Kind("Qwen3ForCausalLM", "internvl2_5", TEXT_MODELS["qwen3"], {}),
    "internvl2_internlm2": Kind("InternLM2ForCausalLM", "internlm2-chat",
                                TEXT_MODELS["llama_dynamic"], {}),
    "vit6b_hermes_qwen2": Kind("Qwen2ForCausalLM", "Hermes-2", {},
                               {"norm_type": "rms_norm", "qk_norm": True,
                                "attention_bias": False}),
}
SMALL_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 2048}


def make_pair(root: Path, name: str, ps_version: str = "v2",
              text: dict | None = None) -> tuple[Path, Path]:
    """(HF-native twin, original-layout checkpoint) of ``KINDS[name]`` under ``root``;
    ``text``: text-config keys over the kind's."""
    kind = KINDS[name]
    text = {**kind.text, **(text or {})}
    if kind.arch != "InternLM2ForCausalLM":
        hf = make_model_dir(root / "hf", text=text, **kind.vision)
        return hf, save_original(hf, root / "original", template=kind.template,
                                 arch=kind.arch, ps_version=ps_version)
    tok_dir = root / "tokenizer"
    tok = save_sentencepiece_tokenizer(tok_dir)
    hf = save_random_internvl(
        root / "hf", tile=56, patch=14, max_tiles=6, initializer_range=0.1, tokenizer=tok,
        vision=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, attention_bias=True, layer_scale_init_value=0.5),
        text={**SMALL_TEXT, **text})
    return hf, save_original(hf, root / "original", template=kind.template, arch=kind.arch,
                             ps_version=ps_version, tokenizer=tok_dir)


def modules(path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A checkpoint's (vision, decoder), as the loader builds them, no tokenizer read."""
    family, cfg = family_for(path)
    spec = family.read_spec(path, cfg)
    sd = {family.normalise_key(k): t for k, t in raw_state_dict(path).items()}
    vision, llm = family.build(spec, sd, path)
    return vision.eval(), llm.eval()
