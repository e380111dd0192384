"""The transformers baselines of ``vlmbatch bench`` and ``bench/qpm.py`` on a Qwen-VL checkpoint:
what a transformers user writes from the Qwen-VL model cards, ``AutoModelForImageTextToText`` on
SDPA, pixels from the image processor (``Qwen2VLImageProcessorPil``: the default processor needs
torchvision, absent here), prompts as our builder makes them (the chat template with the image pad
expanded, as ``Qwen2VLProcessor`` does).

- ``qwen_per_question``: one forward per question, the image processed again each time.
- ``QwenBatched``: prompts left-padded, ``batch`` per forward, ``attention_mask`` given (from
  which transformers' ``get_rope_index`` builds the M-RoPE positions of left-padded rows),
  ``logits_to_keep=1``; each image processed once per round, but its pixels go through the
  tower once per prompt (``pixel_values`` per prompt: one image per ``<|image_pad|>`` run).

Both return what they computed (``baseline.Work``: vision rows = patch rows, prefilled
tokens); ``bench/flops.py`` counts InternVL's FLOPs only, so the bench prints no FLOP table
for Qwen-VL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmbatch.cli.bench.baseline import (
    BaselineRun,
    TimedBaseline,
    Work,
    _left_pad,
    _p_yes,
    time_once,
)
from vlmbatch.preprocessing.qwen_vl import PatchGrid


def load_qwen_reference(model_dir: Path, device: str, dtype: torch.dtype) -> Any:
    return AutoModelForImageTextToText.from_pretrained(
        str(model_dir), attn_implementation="sdpa").to(device, dtype).eval()


def processor(spec: Any) -> Any:
    p = spec.preprocess
    return Qwen2VLImageProcessorPil(patch_size=p.patch, merge_size=p.merge,
                                    temporal_patch_size=p.temporal, min_pixels=p.min_pixels,
                                    max_pixels=p.max_pixels, image_mean=list(spec.vision.mean),
                                    image_std=list(spec.vision.std))


def _pixels(proc: Any, image: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
    out = proc(images=[Image.open(image).convert("RGB")], return_tensors="pt")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    return out["pixel_values"], (t, h, w)


def _image_tokens(ids: torch.Tensor, spec: Any) -> torch.Tensor:
    """``mm_token_type_ids`` (1 at image pads), which Qwen3-VL's forward asks for."""
    return (ids == spec.image_token_id).int()


def qwen_per_question(ref: Any, spec: Any, prompts: Any, answers: Any, items: list,
                      warm: list) -> BaselineRun:
    proc, yes, no = processor(spec), list(answers.yes_ids), list(answers.no_ids)

    def answer(its: list, work: Work) -> list[float]:
        out: list[float] = []
        with torch.inference_mode():
            for item in its:
                for q in item.questions:
                    pv, thw = _pixels(proc, item.image)  # per question, as a naive loop does
                    ids = torch.tensor([prompts.build_for_grid(
                        q.text, PatchGrid(*thw, spec.vision.merge)).ids])
                    logits = ref(input_ids=ids.to(ref.device),
                                 mm_token_type_ids=_image_tokens(ids, spec).to(ref.device),
                                 pixel_values=pv.to(ref.device, ref.dtype),
                                 image_grid_thw=torch.tensor([thw])).logits[:, -1]
                    out += _p_yes(logits, yes, no)
                    work.vision_tiles += len(pv)
                    work.prefills.append((ids.shape[1], 0))
        return out

    return time_once(answer, items, warm)


class QwenBatched(TimedBaseline):
    """The batched baseline (module docstring), warmed up at construction; ``round()``
    times one round."""

    vision = "vision tower per prompt (pixel_values)"

    def __init__(self, ref: Any, spec: Any, prompts: Any, answers: Any, items: list,
                 warm: list, batch: int = 16, pad_id: int = 0) -> None:
        super().__init__()
        self.ref, self.spec, self.prompts, self.items = ref, spec, prompts, items
        self.proc, self.batch, self.pad_id = processor(spec), batch, pad_id
        self.yes, self.no = list(answers.yes_ids), list(answers.no_ids)
        self._answer(warm, Work())

    @torch.inference_mode()
    def _answer(self, its: list, work: Work) -> list[float]:
        pairs = [(i, q) for i, it in enumerate(its) for q in it.questions]
        pixels = {i: _pixels(self.proc, it.image) for i, it in enumerate(its)}
        out: list[float] = []
        merge, dev = self.spec.vision.merge, self.ref.device
        for lo in range(0, len(pairs), self.batch):
            chunk = pairs[lo: lo + self.batch]
            rows = [self.prompts.build_for_grid(q.text, PatchGrid(*pixels[i][1], merge)).ids
                    for i, q in chunk]
            ids, mask = _left_pad(rows, self.pad_id)
            pv = torch.cat([pixels[i][0] for i, _ in chunk]).to(dev, self.ref.dtype)
            logits = self.ref(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                              mm_token_type_ids=_image_tokens(ids, self.spec).to(dev),
                              pixel_values=pv,
                              image_grid_thw=torch.tensor([pixels[i][1] for i, _ in chunk]),
                              logits_to_keep=1).logits[:, -1]
            out += _p_yes(logits, self.yes, self.no)
            work.vision_tiles += len(pv)
            work.prefills += [(len(r), 0) for r in rows]
        return out
