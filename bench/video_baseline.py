"""The batched transformers baseline of ``bench/video.py``: K questions about each of several
sampled clips, given the same frames our engine gets (the ``PreparedVideo``'s uint8 rows,
normalised as transformers' processors do: ``/255``, mean, std), with what a competent
transformers user writes: ``...ForConditionalGeneration`` on SDPA, fp32 or the bench's
dtype, ``inference_mode``, prompts left-padded and ``batch`` per forward,
``logits_to_keep=1``, ``use_cache=False`` (one forward, nothing generated), and each clip's
vision features computed once per round and passed back for all of its questions
(``mm_encoder_outputs``, a forward argument of transformers 5):

- Qwen2.5-VL: ``get_video_features(pixel_values_videos, video_grid_thw)``; the forward gets
  ``video_grid_thw``, ``second_per_grid_ts`` (2 / the clip's sampling fps) and
  ``mm_token_type_ids`` per prompt, from which ``get_rope_index`` builds the M-RoPE
  positions of left-padded rows (its attention mask).
- InternVL: the frames as tiles, one per frame (transformers' InternVL video path),
  ``get_image_features``; positions from the attention mask, as ``generate`` builds them.

Prompt ids are our builder's (``PromptBuilder.build_parts``), which the model tests check
equal to transformers' processors (``tests/models/test_qwen_vl_media.py``,
``test_internvl_media.py``). ``fault="reverse-frames"`` feeds each clip's frame groups in
reverse order: the fault the bench's P(yes) check must catch (``tests/test_bench_checks.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlmbatch.cli.bench.baseline import TimedBaseline, Work, _left_pad
from vlmbatch.preprocessing.media import PreparedVideo
from vlmbatch.preprocessing.video_plan import VideoPlan, normalise

FAULTS = ("none", "reverse-frames")


def reversed_groups(video: PreparedVideo) -> np.ndarray:
    """The clip's rows with its frame groups in reverse order (the injected fault)."""
    n = len(video.group_hashes)
    return video.rows.reshape(n, -1, *video.rows.shape[1:])[::-1].reshape(video.rows.shape)


class ClipBaseline(TimedBaseline):
    """Batched transformers over ``clips`` x ``questions`` (module docstring), warmed up at
    construction (one untimed round); ``round()`` times one round (features made afresh)."""

    vision = "features once per clip (mm_encoder_outputs)"

    def __init__(self, ref: Any, model: Any, plan: VideoPlan, answers: Any,
                 clips: list[PreparedVideo], questions: list[list[str]], batch: int,
                 fault: str = "none") -> None:
        super().__init__()
        self.ref, self.model, self.plan = ref, model, plan
        self.items = list(zip(clips, questions))
        self.batch, self.fault = batch, fault
        self.qwen = model.spec.model_type.startswith("qwen")
        self.pad = model.tokenizer.pad_token_id or 0
        self.yes, self.no = list(answers.yes_ids), list(answers.no_ids)
        self._answer(self.items, Work())
        self.margins: list[float] = []

    def round(self) -> None:
        """One timed round; ``margins`` (logsumexp yes - no logits) and ``p_yes`` kept."""
        super().round()
        self.margins = self.p_yes
        self.p_yes = torch.sigmoid(torch.tensor(self.margins)).tolist()

    def _pixels(self, video: PreparedVideo) -> torch.Tensor:
        rows = reversed_groups(video) if self.fault == "reverse-frames" else video.rows
        return torch.from_numpy(normalise(rows, self.plan)).to(self.ref.device, self.ref.dtype)

    def _encode(self, clips: list[PreparedVideo]) -> list[torch.Tensor]:
        """New clips' features in one vision call, one tensor per clip."""
        pv = torch.cat([self._pixels(v) for v in clips])
        if self.qwen:
            thw = torch.tensor([v.grid.dims for v in clips])
            return list(self.ref.get_video_features(pixel_values_videos=pv,
                                                    video_grid_thw=thw).pooler_output)
        f = self.ref.get_image_features(pixel_values=pv).pooler_output  # [frames, T, D]
        return list(f.split([len(v.rows) for v in clips]))

    @torch.inference_mode()
    def _answer(self, its: list, work: Work) -> list[float]:
        """Each question's margin, clip by clip."""
        pairs = [(c, q) for c, (_, qs) in enumerate(its) for q in qs]
        last = {c: k for k, (c, _) in enumerate(pairs)}  # a clip's last question
        feats: dict[int, torch.Tensor] = {}
        out: list[float] = []
        for lo in range(0, len(pairs), self.batch):
            chunk = pairs[lo: lo + self.batch]
            new = [c for c in dict.fromkeys(c for c, _ in chunk) if c not in feats]
            if new:
                feats.update(zip(new, self._encode([its[c][0] for c in new])))
                work.vision_tiles += sum(len(its[c][0].group_hashes) for c in new)
            rows = [self.model.prompts.build_parts(q, [its[c][0]]).ids for c, q in chunk]
            ids, mask = _left_pad(rows, self.pad)
            assert bool(mask[:, -1].all()), "left padding: the last column is real"
            logits = self.ref(**self._inputs(ids, mask, [its[c][0] for c, _ in chunk],
                                             [feats[c] for c, _ in chunk])).logits[:, -1]
            margins = (logits[:, self.yes].float().logsumexp(-1)
                       - logits[:, self.no].float().logsumexp(-1))  # as the engine's scoring
            out += margins.tolist()
            work.prefills += [(len(r), 0) for r in rows]
            for c in list(feats):
                if last[c] < lo + self.batch:
                    feats.pop(c)
        return out

    def _inputs(self, ids: torch.Tensor, mask: torch.Tensor, clips: list[PreparedVideo],
                feats: list[torch.Tensor]) -> dict[str, Any]:
        dev = self.ref.device
        kw: dict[str, Any] = dict(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                  logits_to_keep=1, use_cache=False)
        if self.qwen:
            spec = self.model.spec
            kw.update(mm_token_type_ids=(2 * (ids == spec.video_token_id).int()).to(dev),
                      video_grid_thw=torch.tensor([v.grid.dims for v in clips]),
                      second_per_grid_ts=torch.tensor([self.plan.layout.qwen.temporal / v.fps
                                                        for v in clips]),
                      mm_encoder_outputs={"video": BaseModelOutputWithPooling(
                          pooler_output=tuple(feats))})
        else:
            kw.update(position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(dev),
                      mm_encoder_outputs={"image": BaseModelOutputWithPooling(
                          pooler_output=torch.cat(feats))})
        return kw
