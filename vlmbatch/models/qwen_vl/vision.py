"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers on SDPA, uint8 patches in.

Input: the patch rows of several images concatenated, ``[N, C*T*P*P]`` uint8 (the order of
``preprocessing/qwen_vl.py``), and their ``grid_thw``. The tower normalises (mean/std, fp32)
itself, embeds each row with one matmul (the conv3d with stride == kernel, its weight viewed
as ``[D, C*T*P*P]``), runs its blocks with 2-D rotary attention that never crosses an image
(full attention) or a window (Qwen2.5-VL), and merges ``merge x merge`` patches into one LLM
token. Output: ``VisionOutput(embeds [N / merge**2, D_text], deepstack)``, images in input
order; ``deepstack`` holds Qwen3-VL's DeepStack features (same shape each, one per
``deepstack_visual_indexes`` entry; empty for Qwen2/2.5-VL).

Families differ in (tested against transformers' ``model.visual`` for each):
- Qwen2-VL: LayerNorm, fc1-act-fc2 MLP (quick_gelu), LayerNorm merger, no patch bias.
- Qwen2.5-VL: RMSNorm, SwiGLU MLP with biases, RMSNorm merger; blocks not in
  ``fullatt_block_indexes`` attend inside windows of ``window_size`` pixels, for which the
  tokens are regrouped window by window (in merge units) and the merged output put back.
- Qwen3-VL: LayerNorm, gelu-tanh MLP, patch bias, a learned position table resampled to the
  grid (bilinear, align_corners) added after the patch embedding, DeepStack mergers
  (LayerNorm after the 2x2 shuffle) on the outputs of ``deepstack_visual_indexes`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vlmbatch.models.base import VisionOutput
from vlmbatch.models.layers import (
    RMSNorm,  # written out op by op: exports to ONNX (the fused op does not)
    activation,
    fuse_into,
    inverse_frequencies,
    rope_tables,
)
from vlmbatch.models.layers import rope as rotate
from vlmbatch.models.qwen_vl.segments import BlockMask, Segments, segment_attention
from vlmbatch.models.qwen_vl.spec import VisionSpec
from vlmbatch.models.qwen_vl.vision_grid import (
    Grid,
    as_grids,
    frame_lengths,
    interpolate_positions,
    patch_coords,
    window_order,
)


def _norm(s: VisionSpec, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if s.kind == "qwen2_5_vl" else nn.LayerNorm(dim, eps=1e-6)


class Attention(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.heads = s.heads
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden)
        self.proj = nn.Linear(s.hidden, s.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: Segments | BlockMask) -> torch.Tensor:
        # x: [N, D]; cos/sin: [N, 1, d] float32; rotary applied in float32 as the reference
        n, dim = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # each [N, H, d]
        q = rotate(q.float(), cos, sin).to(x.dtype)
        k = rotate(k.float(), cos, sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, seg).reshape(n, dim))


class MLP(nn.Module):
    """fc1 -> act -> fc2 (Qwen2-VL, Qwen3-VL), or gated SwiGLU with biases (Qwen2.5-VL)."""
    fused = False  # the gated form's gate_proj and up_proj as one ``gate_up_proj``
    gate_up_proj: nn.Module  # once fused

    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.gated = s.kind == "qwen2_5_vl"
        self.act = activation(s.act)
        if self.gated:
            self.gate_proj = nn.Linear(s.hidden, s.intermediate)
            self.up_proj = nn.Linear(s.hidden, s.intermediate)
            self.down_proj = nn.Linear(s.intermediate, s.hidden)
        else:
            self.fc1 = nn.Linear(s.hidden, s.intermediate)
            self.fc2 = nn.Linear(s.intermediate, s.hidden)

    def fuse_projections(self, apply: bool = True) -> bool:
        """The gated form's gate_proj and up_proj as one ``gate_up_proj``
        (``layers.fuse_into``)."""
        return self.gated and fuse_into(self, "gate_up_proj", ("gate_proj", "up_proj"), apply)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated and self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, -1)
            return self.down_proj(self.act(gate) * up)
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(s, s.hidden), _norm(s, s.hidden)
        self.attn = Attention(s)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: Segments | BlockMask) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """``merge**2`` consecutive tokens -> one LLM token: norm, concat, fc1-GELU-fc2.
    ``after_shuffle`` (DeepStack mergers): the norm runs on the concatenated vector."""

    def __init__(self, s: VisionSpec, after_shuffle: bool = False) -> None:
        super().__init__()
        wide = s.hidden * s.merge * s.merge
        self.wide, self.after_shuffle = wide, after_shuffle
        self.norm = _norm(s, wide if after_shuffle else s.hidden)
        self.fc1 = nn.Linear(wide, wide)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(wide, s.out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> [N / merge**2, D_text]
        x = self.norm(x.reshape(-1, self.wide)) if self.after_shuffle else self.norm(x)
        return self.fc2(self.act(self.fc1(x.reshape(-1, self.wide))))


@dataclass(frozen=True)
class TowerLayout:
    """The index maths of one call, made before the blocks run (``VisionTower.layout``; a
    budget-padded, static-shape one in ``vision_static.py``). N tokens, U = N / merge**2
    units, C tower width, d head dim."""

    cos: torch.Tensor  # [N, 1, d] float32, in block order (after the window regrouping)
    sin: torch.Tensor
    full: Segments | BlockMask  # attention inside each frame
    window: Segments | BlockMask  # inside each window (Qwen2.5-VL), else = full
    perm: torch.Tensor | None = None  # [U] long: units regrouped window by window
    back: torch.Tensor | None = None  # [U] long: the merged units back in input order
    pos: torch.Tensor | None = None  # Qwen3-VL: [N, C] learned positions, input order


class VisionTower(nn.Module):
    """uint8 patch rows of several images -> merged LLM embeddings (module docstring)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        s = self.spec = spec
        self.patch_embed = nn.Linear(s.row_size, s.hidden, bias=s.kind == "qwen3_vl")
        self.pos_embed = nn.Embedding(s.position_embeddings, s.hidden) if s.kind == "qwen3_vl" \
            else None
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.depth))
        self.merger = Merger(s)
        self.deepstack_merger_list = nn.ModuleList(Merger(s, True) for _ in s.deepstack)
        # x_norm = x_uint8 * scale + shift == (x / 255 - mean) / std per column (channel-major
        # rows: C blocks of T*P*P), kept as Python floats so .to(bf16) leaves them exact
        per = s.row_size // 3
        self.scale = [1.0 / (255.0 * s.std[c]) for c in range(3) for _ in range(per)]
        self.shift = [-s.mean[c] / s.std[c] for c in range(3) for _ in range(per)]
        self._affine: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def affine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(scale, shift)`` ``[C*T*P*P]`` on ``device``, built on its first call."""
        if device not in self._affine:
            self._affine[device] = (torch.tensor(self.scale, device=device),
                                    torch.tensor(self.shift, device=device))
        return self._affine[device]

    def rotary(self, grids: Sequence[Grid],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary tables [N, 1, d] float32: first half of the frequencies from the patch
        row, second half from the column."""
        rows, cols = patch_coords(grids, self.spec.merge, device)
        inv = inverse_frequencies(self.spec.head_dim // 2, self.spec.rope_theta, device)
        freqs = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)  # [N, d/2]
        cos, sin = rope_tables(freqs, torch.float32)
        return cos[:, None], sin[:, None]

    def forward(self, patches: torch.Tensor,
                grid_thw: Sequence[Grid] | torch.Tensor) -> VisionOutput:
        s = self.spec
        grids = as_grids(grid_thw, s.merge)
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patch rows do not fit grids {grids}")
        return self.run(patches, self.layout(grids, patches.device))

    def layout(self, grids: Sequence[Grid], dev: torch.device) -> TowerLayout:
        """The call's positions, segments and window order (host index maths)."""
        s = self.spec
        pos = None if self.pos_embed is None else interpolate_positions(
            self.pos_embed.weight, grids, s.merge)
        cos, sin = self.rotary(grids, dev)
        full = Segments.of(frame_lengths(grids), dev)
        if not s.window:
            return TowerLayout(cos, sin, full, full, pos=pos)
        perm, lengths = window_order(grids, s.merge, s.window // s.merge // s.patch)
        perm = perm.to(dev)
        cos, sin = (by_unit(t, perm, s.merge) for t in (cos, sin))
        return TowerLayout(cos, sin, full, Segments.of(lengths, dev), perm, torch.argsort(perm),
                           pos)

    def run(self, patches: torch.Tensor, lay: TowerLayout) -> VisionOutput:
        """uint8 patch rows ``[N, C*T*P*P]`` through the tower, the index maths given."""
        s = self.spec
        scale, shift = self.affine(patches.device)
        x = self.patch_embed((patches.float() * scale + shift).to(self.patch_embed.weight.dtype))
        if lay.pos is not None:
            x = x + lay.pos.to(x.dtype)
        if lay.perm is not None:
            x = by_unit(x, lay.perm, s.merge)
        deep = []
        for i, blk in enumerate(self.blocks):
            windowed = s.window and i not in s.full_attention_blocks
            x = blk(x, lay.cos, lay.sin, lay.window if windowed else lay.full)
            if i in s.deepstack:
                deep.append(self.deepstack_merger_list[s.deepstack.index(i)](x))
        out = self.merger(x)
        return VisionOutput(out if lay.back is None else out[lay.back], tuple(deep))

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Load transformers' vision weights: keys under ``visual.`` or ``model.visual.``
        (what ``save_pretrained`` writes for Qwen2/2.5-VL and Qwen3-VL respectively)."""
        own = self.state_dict()
        got: dict[str, torch.Tensor] = {}
        for key, t in sd.items():
            name = our_name(key)
            if name is not None:
                got[name] = t.reshape(own[name].shape) if name == "patch_embed.weight" else t
        missing = sorted(set(own) - set(got))
        if missing:
            raise KeyError(f"checkpoint lacks vision weights: {missing[:5]} "
                           f"({len(missing)} missing)")
        unexpected = sorted(set(got) - set(own))
        if unexpected:
            raise KeyError(f"vision weights the config does not expect: {unexpected[:5]}")
        self.load_state_dict(got)


def by_unit(t: torch.Tensor, perm: torch.Tensor, merge: int) -> torch.Tensor:
    """Reorder tokens ``[N, ...]`` by merge unit (``merge**2`` consecutive tokens)."""
    return t.reshape(-1, merge * merge, *t.shape[1:])[perm].reshape(t.shape)


_RENAMES = (("patch_embed.proj.", "patch_embed."), ("merger.ln_q.", "merger.norm."),
            ("merger.mlp.0.", "merger.fc1."), ("merger.mlp.2.", "merger.fc2."),
            ("linear_fc1.", "fc1."), ("linear_fc2.", "fc2."))


def our_name(key: str) -> str | None:
    """A checkpoint key -> our parameter name, or None if it is not a vision weight."""
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            name = key[len(prefix):]
            for theirs, ours in _RENAMES:
                name = name.replace(theirs, ours)
            return name
    return None
