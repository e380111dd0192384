"""M-RoPE position ids of a prompt holding one image (transformers' ``get_rope_index``, the
single-image case), and how they continue while decoding.

A prompt is ``text_before (s tokens, ending with <|vision_start|>) + n image pads + text_after
(starting with <|vision_end|>)``. Positions, on the (t, h, w) axes:

- text before the image: 0..s-1 on all three axes;
- the image's tokens, in the tower's output order (merge units row-major): t = s (a still
  image has one temporal step), h = s + unit row, w = s + unit column;
- text after: all three axes continue from (the largest image position) + 1, i.e. from
  s + max(gh, gw) / merge.

Qwen2.5-VL's ``tokens_per_second`` / ``second_per_grid_t`` scale only the temporal index of
*videos*; for an image the temporal index is 0 before the offset whatever they are (and
transformers 5.24 uses an interval of 1 for images), so they do not enter here.

``delta`` = (largest position + 1) - prompt length; the token at sequence index i >= L (a
generated one) has position i + delta on all three axes. Positions of a prompt do not depend
on what follows, so the positions of a cached prefix are the first entries of the whole
prompt's positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Grid = tuple[int, int, int]


def image_positions(start: int, grid_thw: Grid, merge: int) -> torch.Tensor:
    """[3, n] long positions of one image's n = gh*gw/merge**2 tokens, offset by ``start``."""
    t, h, w = grid_thw
    if t != 1:
        raise ValueError(f"grid_thw {grid_thw}: only still images (t = 1) are supported")
    if h % merge or w % merge:
        raise ValueError(f"grid_thw {grid_thw}: h and w must be multiples of {merge}")
    gh, gw = h // merge, w // merge
    rows = torch.arange(gh).repeat_interleave(gw)
    cols = torch.arange(gw).repeat(gh)
    return start + torch.stack([torch.zeros_like(rows), rows, cols])


def prompt_positions(ids: Sequence[int], image_token_id: int, grid_thw: Grid | None,
                     merge: int) -> tuple[torch.Tensor, int]:
    """``ids`` holding at most one run of ``image_token_id`` -> (positions [3, L] long, delta).

    The run must be exactly the image's token count long; with no image (``grid_thw`` None),
    positions are 0..L-1 on every axis and delta is 0.
    """
    at = [i for i, x in enumerate(ids) if x == image_token_id]
    if grid_thw is None:
        if at:
            raise ValueError(f"{len(at)} image tokens but no grid_thw")
        pos = torch.arange(len(ids)).expand(3, -1).clone()
        return pos, 0
    s = at[0] if at else -1
    n = grid_thw[0] * grid_thw[1] * grid_thw[2] // (merge * merge)
    if not at or at != list(range(s, s + n)):
        raise ValueError(f"need one contiguous run of {n} image tokens "
                         f"{image_token_id} for grid {grid_thw}; found {len(at)}")
    return image_prompt_positions(s, grid_thw, merge, len(ids))


def image_prompt_positions(start: int, grid_thw: Grid, merge: int,
                           length: int) -> tuple[torch.Tensor, int]:
    """``prompt_positions`` of a prompt of ``length`` tokens whose image run starts at
    ``start`` (the caller vouches for the ids): (positions [3, length] long, delta)."""
    img = image_positions(start, grid_thw, merge)
    after = length - start - img.shape[1]
    if start < 0 or after < 0:
        raise ValueError(f"an image of {img.shape[1]} tokens at {start} does not fit a "
                         f"prompt of {length}")
    nxt = int(img.max()) + 1
    pos = torch.cat([torch.arange(start).expand(3, -1), img,
                     (nxt + torch.arange(after)).expand(3, -1)], dim=1)
    return pos, nxt + after - length


def batch_positions(rows: Sequence[torch.Tensor], length: int | None = None) -> torch.Tensor:
    """Per-row positions [3, L_b] -> [3, B, T] right-padded with zeros (T = max L_b or
    ``length``), the ``positions`` argument of a batched prefill."""
    t = max(r.shape[1] for r in rows) if length is None else length
    out = torch.zeros(3, len(rows), t, dtype=torch.long)
    for b, r in enumerate(rows):
        out[:, b, : r.shape[1]] = r
    return out


# One visual block of a prompt holding several (``parts_prompt_positions``): where its tokens
# start in the ids, its grid (t, h, w) in patches, and the temporal step per grid step
# (transformers' ``time_interval``: 1, or Qwen2.5-VL's video ``tokens_per_second *
# second_per_grid_t`` as a float32 0-d tensor, the reference's dtype).
Block = tuple[int, Grid, float | torch.Tensor]


def block_positions(start: int, grid_thw: Grid, merge: int,
                    interval: float | torch.Tensor = 1) -> torch.Tensor:
    """[3, t*gh*gw] positions of one image or video block whose first position is ``start``:
    t = floor(step * interval) + start, h/w = start + unit row/column (transformers 5's
    ``get_vision_position_ids``; the multiply happens before the offset, in the interval's
    dtype, then truncates)."""
    t, h, w = grid_thw
    if h % merge or w % merge:
        raise ValueError(f"grid_thw {grid_thw}: h and w must be multiples of {merge}")
    gh, gw = h // merge, w // merge
    steps = (torch.arange(t) * interval).long()
    tt, hh, ww = torch.meshgrid(steps, torch.arange(gh), torch.arange(gw), indexing="ij")
    return start + torch.stack([tt, hh, ww]).reshape(3, -1)


def parts_prompt_positions(blocks: Sequence[Block], merge: int,
                           length: int) -> tuple[torch.Tensor, int]:
    """(positions [3, length], delta) of a prompt holding several visual blocks, in order
    (transformers 5's ``get_rope_index``): text runs count on from the last position; after
    a block the next text starts at the block's start + max(gh, gw) (whatever its temporal
    span), and ``delta`` = largest position + 1 - length."""
    pieces, pos, at = [], 0, 0
    for start, grid_thw, interval in blocks:
        if start < at:
            raise ValueError(f"visual blocks overlap or are out of order at {start}")
        pieces.append(pos + torch.arange(start - at).expand(3, -1))
        pos += start - at
        block = block_positions(pos, grid_thw, merge, interval)
        pieces.append(block)
        at = start + block.shape[1]
        pos += max(grid_thw[1], grid_thw[2]) // merge
    if at > length:
        raise ValueError(f"visual blocks end at {at}, past a prompt of {length}")
    pieces.append(pos + torch.arange(length - at).expand(3, -1))
    out = torch.cat(pieces, dim=1)
    return out, int(out.max()) + 1 - length
