"""Model FLOPs from the shapes: the vision encoder per tile, the LLM prefill per sequence.

Counts matrix products only (2 FLOPs per multiply-add), the convention of MFU figures and of
``torch.utils.flop_counter.FlopCounterMode``: norms, activations, rotary, softmax, pixel
shuffle and the position-embedding resize are left out (a few percent at most).

Vision encoder, per tile of S x S pixels, g = S / patch, L = g^2 + 1 tokens (CLS), C hidden,
I intermediate, R layers run (``feature_layer``), T = tokens_per_tile, D text hidden::

    patch embed   2 * g^2 * (3 * patch^2) * C
    per layer     QKV 3 * 2*L*C*C, O 2*L*C*C, scores 2*L*L*C, attention x V 2*L*L*C,
                  MLP 2 * 2*L*C*I
    projector     2*T*(4C)*D + 2*T*D*D        (after pixel shuffle: T tokens of 4C)

LLM prefill of ``new`` tokens after ``cached`` ones (D hidden, H/K query/KV heads of d,
I intermediate, V vocabulary), per layer::

    linears       new * (2*D*H*d + 2 * 2*D*K*d + 2*H*d*D + 3 * 2*D*I)
    attention     4*H*d * keys, keys = sum over new tokens of the keys each attends to:
                  causal: new*cached + new*(new+1)/2; dense: new*(cached+new)
    LM head       2*D*V at the last token only (what P(yes) needs)

``causal=True`` (the default, what the bench reports) counts what a causal kernel must do;
``causal=False`` counts the full masked rectangle, which is what ``FlopCounterMode`` counts
for SDPA with a mask (``tests/test_flops.py`` compares like with like). Padding is never
counted: these are the useful FLOPs of a workload, not what a padded batch executed.

The spec arguments are duck-typed (``ModelSpec``/``VisionSpec``/``TextSpec`` of
``models/``; only their fields are read).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionFlops:
    """FLOPs of one tile through the vision encoder, by part."""

    patch_embed: int
    qkv_o: int  # attention projections, all layers run
    attention: int  # scores + attention x V, all layers run
    mlp: int
    projector: int

    @property
    def total(self) -> int:
        return self.patch_embed + self.qkv_o + self.attention + self.mlp + self.projector


def vision_tile_flops(v: Any, tile: int) -> VisionFlops:
    """One ``tile`` x ``tile`` tile through ``v`` (a ``VisionSpec``)."""
    g = tile // v.patch
    seq, c = g * g + 1, v.hidden
    run = v.feature_layer % (v.layers + 1)  # layers actually run, as VisionEncoder.forward
    r2 = round(1 / v.downsample) ** 2  # channels grow by r^2 in the pixel shuffle
    tokens = int(g * g * v.downsample**2)
    d = v.text_hidden
    return VisionFlops(
        patch_embed=2 * g * g * 3 * v.patch * v.patch * c,
        qkv_o=run * 4 * 2 * seq * c * c,
        attention=run * 2 * 2 * seq * seq * c,
        mlp=run * 2 * 2 * seq * c * v.intermediate,
        projector=2 * tokens * r2 * c * d + 2 * tokens * d * d,
    )


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of one sequence's prefill, by part."""

    linears: int
    attention: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.linears + self.attention + self.lm_head


def attended_keys(new: int, cached: int, causal: bool = True) -> int:
    """Sum over the ``new`` tokens of how many keys each attends to (itself included)."""
    if causal:
        return new * cached + new * (new + 1) // 2
    return new * (cached + new)


def prefill_flops(t: Any, new: int, cached: int = 0, causal: bool = True,
                  lm_head: bool = True) -> PrefillFlops:
    """``new`` tokens after ``cached`` ones through ``t`` (a ``TextSpec``), LM head on the
    last token only."""
    d, hd = t.hidden, t.head_dim
    per_token = (2 * d * t.heads * hd + 2 * 2 * d * t.kv_heads * hd + 2 * t.heads * hd * d
                 + 3 * 2 * d * t.intermediate)
    return PrefillFlops(
        linears=t.layers * new * per_token,
        attention=t.layers * 4 * t.heads * hd * attended_keys(new, cached, causal),
        lm_head=2 * d * t.vocab if lm_head and new > 0 else 0,
    )


def workload_flops(spec: Any, vision_tiles: int, prefills: Iterable[tuple[int, int]],
                   causal: bool = True) -> int:
    """Total FLOPs of ``vision_tiles`` tiles through the encoder plus one prefill per
    ``(new, cached)`` pair, for ``spec`` (a ``ModelSpec``)."""
    per_tile = vision_tile_flops(spec.vision, spec.tiling.tile_size).total
    return vision_tiles * per_tile + sum(prefill_flops(spec.text, n, c, causal).total
                                         for n, c in prefills)
