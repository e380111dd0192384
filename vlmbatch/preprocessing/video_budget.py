"""A clip's visual token budget (``--max-video-tokens``, a line's ``max_video_tokens``) and
the model's context, as limits on one clip.

What a budget of ``B`` tokens changes, per family, so that the clip's visual tokens are at
most ``B`` (the prompt's text tokens come on top):

- Qwen2-VL, Qwen2.5-VL (a per-frame pixel bound): the frames are made smaller, never fewer.
  The video processor's ``max_pixels`` (``size["longest_edge"]``, per frame) is lowered to
  ``floor(B / groups) * f**2`` (``groups`` = temporal patches, ``f`` = patch x merge), the
  bound a user would pass to transformers' processor for the same frames; ``min_pixels``
  follows it down where it is larger. Every frame is resized with that bound, as the
  processor resizes with it. A clip that fits the budget at the checkpoint's own bound is
  left as it is.
- Qwen3-VL, Qwen3.5 (a pixel bound over the whole clip): the same, on the clip-wide
  ``max_pixels``: ``floor(B * f**2 * frames / groups)``.
- InternVL (one tile per frame, ``frame_tokens`` each): the frames are made fewer, never
  smaller: a clip sampled to more than ``B // frame_tokens`` frames is sampled as
  ``num_frames = B // frame_tokens`` instead (transformers' InternVL rule for that count).

Where the processor's rounding lands a size over the budget (a pixel floor rounded up, an
odd frame count under Qwen3-VL's rounding), the same bound is tried with the floor at one
merge unit, then the bound is lowered in proportion, a few times;
a budget no size meets (fewer tokens than one merge unit per temporal patch, or than one
frame's tile) raises ``VideoTooLarge`` (reason ``over_budget``), naming what to change.
``check_context``: a clip whose visual tokens alone reach the model's context is refused
the same way (reason ``over_context``), before the engine would be handed a prompt it
cannot hold.
"""

from __future__ import annotations

import dataclasses

from vlmbatch.preprocessing.video import VideoTooLarge
from vlmbatch.preprocessing.video_rows import QwenVideoLayout

_RETRIES = 8  # lowering the bound again where rounding overshot (module docstring)


def qwen_tokens(layout: QwenVideoLayout, frames: int, size: tuple[int, int]) -> int:
    """Visual tokens of ``frames`` frames at ``size`` (h, w): temporal patches x merged
    patches per frame (``video_grid_thw.prod() // merge**2``)."""
    q = layout.qwen
    return -(-frames // q.temporal) * (size[0] // q.factor) * (size[1] // q.factor)


def qwen_budget_size(layout: QwenVideoLayout, frames: int, height: int, width: int,
                     budget: int) -> tuple[int, int]:
    """The (h, w) every frame is resized to so that the clip holds at most ``budget`` visual
    tokens (module docstring); ``VideoTooLarge`` when no size does."""
    q = layout.qwen
    groups, unit = -(-frames // q.temporal), q.factor * q.factor
    cap = budget * unit * frames // groups if layout.clip_budget else budget // groups * unit
    cap = min(cap, q.max_pixels)
    size = layout.target_size(frames, height, width)
    if (tokens := qwen_tokens(layout, frames, size)) <= budget:
        return size  # a budget the clip already fits changes nothing
    for _ in range(_RETRIES):
        if cap < unit:
            break
        # the pixel floor follows the bound down; where rounding it up overshoots, without it
        for floor in (min(q.min_pixels, cap), unit):
            bounded = dataclasses.replace(q, max_pixels=cap, min_pixels=floor)
            size = dataclasses.replace(layout, qwen=bounded).target_size(frames, height, width)
            tokens = qwen_tokens(layout, frames, size)
            if tokens <= budget:
                return size
        cap = cap * budget // tokens  # still over: lower the bound in proportion
    at = f" (at {size[1]}x{size[0]} px, {tokens:,} tokens)" if tokens else ""
    raise VideoTooLarge(f"the clip's {frames} frames ({groups} temporal patches) do not fit "
                        f"the budget of {budget:,} visual tokens at any size{at}: raise "
                        "--max-video-tokens / the line's max_video_tokens, or sample fewer "
                        "frames (num_frames, fps, max_frames)", "over_budget")


def internvl_frames(budget: int, frame_tokens: int) -> int:
    """How many frames of ``frame_tokens`` tokens each fit ``budget``; ``VideoTooLarge``
    when not one does."""
    n = budget // frame_tokens
    if n < 1:
        raise VideoTooLarge(f"one frame is {frame_tokens} visual tokens, over the budget of "
                            f"{budget:,} (raise --max-video-tokens / the line's "
                            "max_video_tokens)", "over_budget")
    return n


def check_context(tokens: int, context: int) -> None:
    """``VideoTooLarge`` when a clip's ``tokens`` visual tokens leave no room for a question
    in the model's ``context`` (0: none stated, nothing checked)."""
    if context > 0 and tokens >= context:
        raise VideoTooLarge(f"the clip is {tokens:,} visual tokens, over the model's context "
                            f"of {context:,} tokens (config.json max_position_embeddings); "
                            "set --max-video-tokens (or the line's max_video_tokens) below it, "
                            "or sample fewer frames", "over_context")


@dataclasses.dataclass(frozen=True)
class BudgetedLayout:
    """A Qwen-VL layout whose ``target_size`` keeps the clip within ``budget`` tokens (what
    ``video_rows.fit_for`` asks for the size to resize every frame to)."""
    layout: QwenVideoLayout
    budget: int

    def target_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        return qwen_budget_size(self.layout, frames, height, width, self.budget)
