"""The transformers baselines of ``vlmbatch bench --baseline transformers`` and
``bench/qpm.py``: what a transformers user writes from InternVL's model card, with
``InternVLForConditionalGeneration`` on SDPA attention.

- ``per_question``: one forward per question, the image decoded and tiled again each time
  (the naive loop; the bench's second reference).
- ``Batched``: what a competent user writes (the bench's headline reference). Tiles made once
  per image with the model card's Pillow path (``preprocessing/reference.py``); prompts
  left-padded and batched (``batch`` per forward), ``position_ids`` from the attention mask
  as ``generate`` builds them, ``logits_to_keep=1``. Left padding puts every row's last real
  token in the last column, so the logits kept are each row's last real token (asserted).
  Vision: transformers 5 lets a caller pass precomputed image features
  (``forward(mm_encoder_outputs={"image": ...})``, the output of ``get_image_features``), so
  ``reuse_features=True`` (the default) encodes each image once, the new images of a batch in
  one vision call, and reuses its features for all of its questions, as a competent user
  reading that signature would. ``reuse_features=False`` passes ``pixel_values`` per prompt
  (the image's tensor reused, the vision tower run for every question, as plain
  ``model(**inputs)`` does).

Both time preprocessing too (file bytes -> tiles), as the vlmbatch rows do, and return what
they computed (``Work``) for the FLOP counts of ``bench/flops.py``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import InternVLForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlmbatch.preprocessing.reference import pillow_tiles, pixel_values


@dataclass
class Work:
    """What a path computed: tiles through the vision encoder, and per LLM sequence
    ``(new tokens prefilled, tokens already cached)``; padding not counted."""

    vision_tiles: int = 0
    prefills: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class BaselineRun:
    p_yes: list[float]
    seconds: float  # best of the timed rounds
    work: Work  # of one round
    vision: str  # how the vision tower ran


def load_reference(model_dir: Path, device: str, dtype: torch.dtype) -> Any:
    return InternVLForConditionalGeneration.from_pretrained(
        str(model_dir), attn_implementation="sdpa").to(device, dtype).eval()


def can_pass_features(ref: Any) -> bool:
    """Whether this transformers' forward takes precomputed image features."""
    return "mm_encoder_outputs" in inspect.signature(ref.forward).parameters


def _p_yes(logits: torch.Tensor, yes: list[int], no: list[int]) -> list[float]:
    # logits: [B, V] -> P(yes) per row, as the engine's scoring (logsumexp per side)
    logits = logits.float()
    return torch.sigmoid(logits[:, yes].logsumexp(-1) - logits[:, no].logsumexp(-1)).tolist()


def _tiles(spec: Any, image: str) -> torch.Tensor:
    """Image file -> normalised pixel values ``[tiles, 3, S, S]`` float32 (model card)."""
    t = spec.tiling
    tiles = pillow_tiles(Path(image).read_bytes(), t.tile_size, t.min_tiles, t.max_tiles)
    return pixel_values(tiles, spec.vision.mean, spec.vision.std)


def per_question(ref: Any, spec: Any, prompts: Any, answers: Any, items: list, warm: list
                 ) -> BaselineRun:
    """One forward per question; P(yes) from the last position's logits. One timed round."""
    device, dtype = ref.device, ref.dtype
    yes, no = list(answers.yes_ids), list(answers.no_ids)

    def answer(its: list, work: Work) -> list[float]:
        out: list[float] = []
        with torch.inference_mode():
            for item in its:
                for q in item.questions:
                    pv = _tiles(spec, item.image)  # per question, as a naive loop does
                    ids = torch.tensor([prompts.build_for_tiles(q.text, len(pv)).ids])
                    logits = ref(input_ids=ids.to(device),
                                 pixel_values=pv.to(device, dtype)).logits[:, -1]
                    out += _p_yes(logits, yes, no)
                    work.vision_tiles += len(pv)
                    work.prefills.append((ids.shape[1], 0))
        return out

    return time_once(answer, items, warm)


def time_once(answer: Any, items: list, warm: list) -> BaselineRun:
    """``answer(items, work)`` timed once after an untimed ``answer(warm, ...)``."""
    answer(warm, Work())
    work = Work()
    start = time.perf_counter()
    out = answer(items, work)
    return BaselineRun(out, time.perf_counter() - start, work, "per question")


def _left_pad(rows: list[tuple[int, ...]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows -> (input_ids, attention_mask), each ``[B, T]``, padded on the left."""
    t = max(map(len, rows))
    ids = torch.tensor([[pad] * (t - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (t - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


class TimedBaseline:
    """A baseline timed in rounds: ``round()`` answers ``self.items`` afresh (``_answer``),
    keeping its time, P(yes) and work; ``result()`` the best round."""

    items: list
    vision: str

    def __init__(self) -> None:
        self.times: list[float] = []
        self.p_yes: list[float] = []
        self.work = Work()

    def _answer(self, its: list, work: Work) -> list[float]:
        raise NotImplementedError

    def round(self) -> None:
        work = Work()
        start = time.perf_counter()
        self.p_yes = self._answer(self.items, work)
        self.times.append(time.perf_counter() - start)
        self.work = work

    def result(self) -> BaselineRun:
        return BaselineRun(self.p_yes, min(self.times), self.work, self.vision)


class Batched(TimedBaseline):
    """The batched baseline, warmed up at construction; ``round()`` times one round (a fresh
    pass over ``items``: tiles and features are made again each round)."""

    def __init__(self, ref: Any, spec: Any, prompts: Any, answers: Any, items: list,
                 warm: list, batch: int = 16, reuse_features: bool = True,
                 pad_id: int = 0) -> None:
        super().__init__()
        self.ref, self.spec, self.prompts, self.items = ref, spec, prompts, items
        self.batch, self.pad_id = batch, pad_id
        self.reuse = reuse_features and can_pass_features(ref)
        self.yes, self.no = list(answers.yes_ids), list(answers.no_ids)
        self.vision = ("features once per image (mm_encoder_outputs)" if self.reuse
                       else "vision tower per prompt (pixel_values)")
        self._answer(warm, Work())

    @torch.inference_mode()
    def _answer(self, its: list, work: Work) -> list[float]:
        pairs = [(i, q) for i, it in enumerate(its) for q in it.questions]
        last = {i: k for k, (i, _) in enumerate(pairs)}  # an image's last question
        pvs: dict[int, torch.Tensor] = {}  # image -> [tiles, 3, S, S], made once
        feats: dict[int, torch.Tensor] = {}  # image -> [tiles, T, D], encoded once
        out: list[float] = []
        for lo in range(0, len(pairs), self.batch):
            chunk = pairs[lo: lo + self.batch]
            images = list(dict.fromkeys(i for i, _ in chunk))
            for i in images:
                if i not in pvs:
                    pvs[i] = _tiles(self.spec, its[i].image)
            rows = [self.prompts.build_for_tiles(q.text, len(pvs[i])).ids for i, q in chunk]
            kw = self._inputs(rows)
            if self.reuse:
                kw["mm_encoder_outputs"] = {"image": self._features(chunk, images, pvs, feats,
                                                                    work)}
            else:
                kw["pixel_values"] = torch.cat([pvs[i] for i, _ in chunk]).to(
                    self.ref.device, self.ref.dtype)
                work.vision_tiles += len(kw["pixel_values"])
            logits = self.ref(**kw).logits[:, -1]  # [B, V] at each row's last real token
            out += _p_yes(logits, self.yes, self.no)
            work.prefills += [(len(r), 0) for r in rows]
            for i in images:
                if last[i] < lo + self.batch:  # all its questions answered
                    pvs.pop(i)
                    feats.pop(i, None)
        return out

    def _inputs(self, rows: list[tuple[int, ...]]) -> dict[str, Any]:
        """Left-padded ids, mask, positions from the mask (as ``generate`` builds them)."""
        ids, mask = _left_pad(rows, self.pad_id)
        assert bool(mask[:, -1].all()), "left padding: the last column is real"
        device = self.ref.device
        return dict(input_ids=ids.to(device), attention_mask=mask.to(device),
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device),
                    logits_to_keep=1)

    def _features(self, chunk: list, images: list[int], pvs: dict, feats: dict,
                  work: Work) -> Any:
        """The chunk's image features, prompt by prompt; new images encoded in one call."""
        new = [i for i in images if i not in feats]
        if new:
            f = self.ref.get_image_features(
                pixel_values=torch.cat([pvs[i] for i in new]).to(self.ref.device,
                                                                 self.ref.dtype)
            ).pooler_output  # [tiles of the new images, T, D]
            feats.update(zip(new, f.split([len(pvs[i]) for i in new])))
            work.vision_tiles += len(f)
        return BaseModelOutputWithPooling(pooler_output=torch.cat([feats[i] for i, _ in chunk]))
