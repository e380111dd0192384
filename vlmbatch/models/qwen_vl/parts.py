"""Qwen-VL prompts holding several visual parts (images and clips, in order), as transformers
5.25's processors and chat templates write them, and the blocks their M-RoPE positions are
made from (``positions.parts_prompt_positions``).

The chat template renders every image part as ``<|vision_start|><|image_pad|><|vision_end|>``
and every video part as ``<|vision_start|><|video_pad|><|vision_end|>``, back to back, the
question after the last; the processor then expands each pad:

- an image: ``t*h*w / merge**2`` ``<|image_pad|>`` (as ``prompt.py`` does for one image);
- a clip, Qwen2-VL (``plain``) and Qwen2.5-VL (``scaled``): one run of ``t*h*w / merge**2``
  ``<|video_pad|>``, t = frames / temporal patch (2); its temporal positions step by
  ``tokens_per_second * second_per_grid_t`` per temporal patch for Qwen2.5-VL
  (``second_per_grid_t`` = temporal patch / the sampling fps, ``PreparedVideo.fps``, in
  float32 as the processor's tensor, truncated), by 1 for Qwen2-VL;
- a clip, Qwen3-VL and Qwen3.5 (``timestamps``): per temporal patch ``g``, the text
  ``<{s:.1f} seconds>`` (s = the mean time of the patch's first and last frame) then
  ``<|vision_start|>`` + ``h*w / merge**2`` ``<|video_pad|>`` + ``<|vision_end|>``; each
  patch's positions are those of a one-frame image. transformers 5.25's ``Qwen3VLProcessor``
  replaces the template's outer ``<|vision_start|><|video_pad|><|vision_end|>`` by this
  expansion (``get_text_with_replacements`` collapses the wrapper: no outer pair).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vlmbatch.models.qwen_vl.positions import Block
from vlmbatch.preprocessing.media import MediaPart, PreparedVideo

Runs = tuple[tuple[int, int], ...]  # a part's token runs (start, length) in the ids
STYLES = ("plain", "scaled", "timestamps")


@dataclass(frozen=True)
class VideoRule:
    """How a kind writes a clip (module docstring)."""
    token_id: int  # <|video_pad|>
    style: str  # one of STYLES
    temporal: int = 2  # frames per temporal patch
    tokens_per_second: float = 1  # ``scaled`` only


def video_rule(model_type: str, token_id: int, temporal: int,
               tokens_per_second: float) -> VideoRule:
    style = {"qwen2_vl": "plain", "qwen2_5_vl": "scaled"}.get(model_type, "timestamps")
    return VideoRule(token_id, style, temporal, tokens_per_second)


@dataclass(frozen=True)
class Markers:
    image: int  # <|image_pad|>
    start: int  # <|vision_start|>
    end: int  # <|vision_end|>
    merge: int


def part_tokens(part: MediaPart, at: int, marks: Markers, rule: VideoRule | None,
                encode: Callable[[str], list[int]]) -> tuple[list[int], list[Block], Runs]:
    """One part's ids when they start at index ``at``: (ids, position blocks, runs)."""
    t, h, w = part.grid.dims
    if not isinstance(part, PreparedVideo):
        n = t * h * w // marks.merge ** 2
        return [marks.start, *[marks.image] * n, marks.end], [(at + 1, (t, h, w), 1)], \
            ((at + 1, n),)
    if rule is None:
        raise ValueError("this checkpoint's prompts take no video")
    if rule.style != "timestamps":
        n = t * h * w // marks.merge ** 2
        return ([marks.start, *[rule.token_id] * n, marks.end],
                [(at + 1, (t, h, w), _interval(part, rule))], ((at + 1, n),))
    ids: list[int] = []
    blocks: list[Block] = []
    runs = []
    n = h * w // marks.merge ** 2
    for seconds in group_seconds(part.seconds, rule.temporal, t):
        ids += encode(f"<{seconds:.1f} seconds>")
        runs.append((at + len(ids) + 1, n))
        blocks.append((at + len(ids) + 1, (1, h, w), 1))
        ids += [marks.start, *[rule.token_id] * n, marks.end]
    return ids, blocks, tuple(runs)


def _interval(video: PreparedVideo, rule: VideoRule) -> float | torch.Tensor:
    if rule.style == "plain":
        return 1
    if not video.fps > 0:
        raise ValueError(f"a clip's sampling fps must be positive for Qwen2.5-VL's time "
                         f"positions; got {video.fps}")
    return torch.tensor(rule.temporal / video.fps, dtype=torch.float32) * rule.tokens_per_second


def group_seconds(seconds: Sequence[float], temporal: int, groups: int) -> list[float]:
    """Each temporal patch's time: the mean of its first and last frame's, the last frame
    repeated to fill a patch (transformers' ``Qwen3VLProcessor._calculate_timestamps``)."""
    s = list(seconds)
    if not s:
        raise ValueError("a clip without frame times cannot be written with timestamps")
    s += [s[-1]] * (-len(s) % temporal)
    if len(s) // temporal != groups:
        raise ValueError(f"{len(seconds)} frame times for {groups} temporal patches of "
                         f"{temporal} frames")
    return [(s[i] + s[i + temporal - 1]) / 2 for i in range(0, len(s), temporal)]
