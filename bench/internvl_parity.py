"""Parity figures of InternVL's other checkpoints (``docs/internvl.md``), fp32 on the CPU.

    python bench/internvl_parity.py

Prints the max |difference| of: InternVL3.5 (Qwen3 text, with and without biases) against
transformers' ``InternVLForConditionalGeneration`` (the whole logits row, three aspect
ratios); each original-layout checkpoint against its HF-native twin (vision output, decoder
logits); InternLM2 against the published forward (``tests/models/test_internlm2.py``) and
against transformers' ``LlamaForCausalLM`` on the re-laid weights. Random checkpoints are
built by the tests' helpers in a temporary folder; nothing is downloaded. The tests assert
the tolerances (1e-4, 1e-6, 1e-5); this prints what they measure.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import InternVLForConditionalGeneration, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import TEXT_MODELS, make_model_dir, reference_pixels  # noqa: E402
from tests.models.internvl_original_helpers import KINDS, make_pair, modules  # noqa: E402
from tests.models.test_internlm2 import (  # noqa: E402
    LENGTHS,
    PublishedInternLM2,
    batched_logits,
    embeds,
    fresh_published,
)
from tests.models.test_internvl_reference import fresh, logits_row  # noqa: E402
from vlmbatch.engine.loading import load_model  # noqa: E402
from vlmbatch.models.io import raw_state_dict  # noqa: E402
from vlmbatch.preprocessing.prepare import prepare  # noqa: E402

SIZES = [(56, 56), (200, 90), (30, 170)]  # (w, h): one tile, wide, tall


def qwen3_row(root: Path, name: str) -> float:
    """Max |ours - transformers| over the whole last logits row, each of ``SIZES``."""
    path = make_model_dir(root / name, text=TEXT_MODELS[name])
    ours = load_model(path)
    ref = InternVLForConditionalGeneration.from_pretrained(str(path)).eval()
    rng, worst = np.random.default_rng(1), 0.0
    for w, h in SIZES:
        im = prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
        p = ours.prompts.build("Is there a red shape?", im)
        with torch.no_grad():
            want = fresh(ref)(input_ids=torch.tensor([list(p.ids)]), pixel_values=(
                reference_pixels(torch.from_numpy(im.tiles)))).logits[0, -1]
        got = logits_row(ours.vision, ours.llm, p, torch.from_numpy(im.tiles))
        worst = max(worst, float((got - want).abs().max()))
    return worst


def twin_gap(root: Path, name: str) -> tuple[float, float]:
    """(vision, decoder logits) max |original - HF-native twin|, two rows of 45 and 30."""
    hf, original = make_pair(root / name, name)
    (v1, l1), (v2, l2) = modules(hf), modules(original)
    g = torch.Generator().manual_seed(0)
    tiles = torch.randint(0, 256, (3, 56, 56, 3), dtype=torch.uint8, generator=g)
    x, lengths = torch.randn(2, 45, l1.spec.hidden, generator=g), torch.tensor([45, 30])
    with torch.no_grad():
        dv = float((v1(tiles) - v2(tiles)).abs().max())
        dl = float((l1.prefill(x, lengths)[0] - l2.prefill(x, lengths)[0]).abs().max())
    return dv, dl


def internlm2_gaps(root: Path) -> tuple[float, float]:
    """(vs the published forward, vs LlamaForCausalLM) on prompts of ``LENGTHS``."""
    hf, original = make_pair(root / "internlm2", "internvl2_internlm2")
    cfg = json.loads((original / "config.json").read_text())["llm_config"]
    published = PublishedInternLM2(raw_state_dict(original), cfg)
    xs = [embeds(n, cfg["hidden_size"], n) for n in LENGTHS]
    got = batched_logits(modules(original)[1], xs)
    text = json.loads((hf / "config.json").read_text())["text_config"]
    llama = LlamaForCausalLM(LlamaConfig(**text)).eval()
    llama.load_state_dict({k[len("language_model."):]: t for k, t in raw_state_dict(hf).items()
                           if k.startswith("language_model.")})
    pub = lla = 0.0
    for row, x in zip(got, xs):
        rot = llama.model.rotary_emb  # a fresh table per prompt (test_internvl_reference.fresh)
        rot.inv_freq, rot.max_seq_len_cached = rot.original_inv_freq, rot.original_max_seq_len
        with torch.no_grad():
            pub = max(pub, float((row - fresh_published(published)(x)[0][-1]).abs().max()))
            lla = max(lla, float((row - llama(inputs_embeds=x[None]).logits[0, -1]).abs().max()))
    return pub, lla


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("qwen3", "qwen3_no_bias"):
            print(f"InternVL3.5 ({name}) logits row vs transformers, 3 aspect ratios: "
                  f"{qwen3_row(root, name):.2e}")
        for name in sorted(KINDS):
            dv, dl = twin_gap(root, name)
            print(f"original layout vs HF-native twin ({name}): vision {dv:.2e}, "
                  f"decoder logits {dl:.2e}")
        pub, lla = internlm2_gaps(root)
        print(f"InternLM2 vs the published forward (prompts {LENGTHS}, dynamic NTK past 32): "
              f"{pub:.2e}")
        print(f"InternLM2 vs transformers' LlamaForCausalLM on the re-laid weights: {lla:.2e}")


if __name__ == "__main__":
    main()
