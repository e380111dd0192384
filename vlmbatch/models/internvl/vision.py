"""InternViT vision encoder + pixel shuffle + MLP projector, with SDPA attention.

Input is uint8 tiles ``[N, S, S, 3]`` (RGB, as preprocessing emits them); normalisation to the
model's mean/std happens here, fused into one multiply-add per channel, on the encoder's
device. Output is LLM-ready image embeddings ``[N, T, D_text]`` with
``T = (S / patch)^2 * downsample_ratio^2`` tokens per tile.

The weights and the maths are those of transformers' ``InternVLModel.get_image_features``
(vision tower, CLS dropped, pixel shuffle, projector); ``tests/vit_trt`` checks equality on
random weights. Attention is ``torch.nn.functional.scaled_dot_product_attention`` (no flash-attn
function), so the module exports to ONNX (``vit_trt/export.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.models.layers import RMSNorm, activation, fuse_into


@dataclass(frozen=True)
class VisionSpec:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    patch: int
    image_size: int  # the size position embeddings were trained at
    norm_type: str  # "layer_norm" | "rms_norm"
    eps: float
    qk_norm: bool
    act: str
    mean_pooling: bool  # True: no final layernorm on the last hidden state
    feature_layer: int  # which hidden state feeds the projector (-1: last)
    drop_cls: bool  # vision_feature_select_strategy == "default"
    downsample: float  # pixel-shuffle ratio, 0.5 in every InternVL
    projector_act: str
    text_hidden: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # pixel shuffle: "v2" (HF-native, every InternVL2+ release) or the original layout's
    # "v1", which leaves the shuffled grid transposed (``pixel_shuffle``)
    ps_version: str = "v2"
    qk_norm_eps: float = 1e-6  # transformers' fixed value; the original reads layer_norm_eps

    def __post_init__(self) -> None:
        if self.ps_version not in ("v1", "v2"):
            raise ValueError(f"ps_version {self.ps_version!r} not one of 'v1', 'v2'")

    def tokens_per_tile(self, tile: int) -> int:
        return int((tile // self.patch) ** 2 * self.downsample**2)


def _norm(spec: VisionSpec, dim: int) -> nn.Module:
    return RMSNorm(dim, spec.eps) if spec.norm_type == "rms_norm" else nn.LayerNorm(dim, spec.eps)


class VisionLayer(nn.Module):
    fused = False  # q_proj, k_proj, v_proj as one ``qkv_proj`` (``fuse_projections``)
    qkv_proj: nn.Module  # once fused
    scaled = False  # ls1, ls2 folded into o_proj's and fc2's rows (``fuse_projections``)

    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.heads = s.heads
        self.qk_norm = s.qk_norm
        self.q_proj = nn.Linear(s.hidden, s.hidden)
        self.k_proj = nn.Linear(s.hidden, s.hidden)
        self.v_proj = nn.Linear(s.hidden, s.hidden)
        self.o_proj = nn.Linear(s.hidden, s.hidden)
        self.q_norm = RMSNorm(s.hidden, s.qk_norm_eps) if s.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(s.hidden, s.qk_norm_eps) if s.qk_norm else nn.Identity()
        self.norm1 = _norm(s, s.hidden)
        self.norm2 = _norm(s, s.hidden)
        self.fc1 = nn.Linear(s.hidden, s.intermediate)
        self.fc2 = nn.Linear(s.intermediate, s.hidden)
        self.ls1 = nn.Parameter(torch.ones(s.hidden))
        self.ls2 = nn.Parameter(torch.ones(s.hidden))
        self.act = activation(s.act)

    def fuse_projections(self, apply: bool = True) -> bool:
        """q_proj, k_proj, v_proj as one linear ``qkv_proj`` (``layers.fuse_into``); and
        the layer scales into the rows of the linears they scale (``ls1 * o_proj(a)`` =
        ``o_proj'(a)`` with o_proj's weight rows and bias times ls1; fc2 likewise): two ops
        fewer a layer, each output the same up to the last bit of rounding."""
        done = fuse_into(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"), apply)
        if done and apply and type(self.o_proj) is nn.Linear and type(self.fc2) is nn.Linear:
            with torch.no_grad():
                for lin, ls in ((self.o_proj, self.ls1), (self.fc2, self.ls2)):
                    lin.weight.mul_(ls[:, None])
                    if lin.bias is not None:
                        lin.bias.mul_(ls)
            self.scaled = True
        return done

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, L, C] -> q, k, v [N, H, L, d] (q and k normed over C where the spec says)."""
        n, L, c = h.shape
        if not self.fused:
            q, k, v = self.q_norm(self.q_proj(h)), self.k_norm(self.k_proj(h)), self.v_proj(h)
        elif not self.qk_norm:  # one view for the three: [N, L, 3, H, d] -> [3, N, H, L, d]
            q, k, v = self.qkv_proj(h).view(n, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            return q, k, v
        else:
            q, k, v = self.qkv_proj(h).chunk(3, -1)
            q, k = self.q_norm(q), self.k_norm(k)
        return tuple(t.view(n, L, self.heads, -1).transpose(1, 2)  # type: ignore[return-value]
                     for t in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, L, C]
        n, L, c = x.shape
        q, k, v = self.qkv(self.norm1(x))
        a = F.scaled_dot_product_attention(q, k, v)  # [N, H, L, d]
        a = self.o_proj(a.transpose(1, 2).reshape(n, L, c))
        x = x + (a if self.scaled else self.ls1 * a)
        m = self.fc2(self.act(self.fc1(self.norm2(x))))
        return x + (m if self.scaled else self.ls2 * m)


class VisionEncoder(nn.Module):
    """uint8 tiles ``[N, S, S, 3]`` -> image embeddings ``[N, T, D_text]``."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        s = spec
        self.patch_embed = nn.Conv2d(3, s.hidden, kernel_size=s.patch, stride=s.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, s.hidden))
        grid = s.image_size // s.patch
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, s.hidden))
        self.layers = nn.ModuleList(VisionLayer(s) for _ in range(s.layers))
        # transformers uses a LayerNorm here whatever norm_type says
        self.final_norm = nn.LayerNorm(s.hidden, s.eps) if not s.mean_pooling else nn.Identity()
        r = int(round(1 / s.downsample))
        self.proj_norm = nn.LayerNorm(s.hidden * r * r)
        self.proj1 = nn.Linear(s.hidden * r * r, s.text_hidden)
        self.proj2 = nn.Linear(s.text_hidden, s.text_hidden)
        self.proj_act = activation(s.projector_act)
        # x_norm = x_uint8 * scale + shift  ==  (x / 255 - mean) / std, kept as Python floats
        # so that .to(bf16) leaves them exact; applied in fp32 like the reference.
        self.scale = [1.0 / (255.0 * sd) for sd in s.std]
        self.shift = [-m / sd for m, sd in zip(s.mean, s.std)]
        self._affine: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def affine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(scale, shift)``, each ``[1, 3, 1, 1]``, on ``device``.

        Built on a device's first call and kept (a plain attribute, so ``.to()`` never casts
        them): building them in every ``forward`` would be a host-to-device copy, which CUDA
        graph capture cannot record (``cudagraph_pool.hazards``). The graph pool's warm-up call
        is that first call.
        """
        if device not in self._affine:
            self._affine[device] = (
                torch.tensor(self.scale, device=device).view(1, 3, 1, 1),
                torch.tensor(self.shift, device=device).view(1, 3, 1, 1))
        return self._affine[device]

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """Position embeddings ``[1, 1 + gh*gw, C]``, bicubic-resized if the tile size differs."""
        trained = self.spec.image_size // self.spec.patch
        if (grid_h, grid_w) == (trained, trained):
            return self.pos_embed
        cls, patch = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        patch = patch.reshape(1, trained, trained, -1).permute(0, 3, 1, 2)
        patch = F.interpolate(patch, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return torch.cat([cls, patch.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, -1)], 1)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, g, g, C]`` -> ``[N, g*r, g*r, C/r^2]`` (r = downsample), InternVL's order;
        ``ps_version`` v1 skips the last transpose back."""
        n, w, h, c = x.shape
        r = self.spec.downsample
        x = x.reshape(n, w, int(h * r), int(c / r)).permute(0, 2, 1, 3)
        x = x.reshape(n, int(h * r), int(w * r), int(c / (r * r)))
        return x if self.spec.ps_version == "v1" else x.permute(0, 2, 1, 3)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        # tiles: [N, S, S, 3] uint8 -> x: [N, 3, S, S] in the weights' dtype
        dtype = self.patch_embed.weight.dtype  # normalise in fp32 (as the reference), then cast
        scale, shift = self.affine(tiles.device)
        # cast first: TensorRT takes a uint8 input only straight into a Cast (ONNX: Cast, Transpose)
        x = tiles.float().permute(0, 3, 1, 2) * scale + shift
        x = x if dtype == torch.float32 else x.to(dtype)  # (a no-op cast is still an op)
        x = self.patch_embed(x)  # [N, C, gh, gw]
        n, c, gh, gw = x.shape
        x = x.flatten(2).transpose(1, 2)  # [N, gh*gw, C]
        x = torch.cat([self.cls_token.expand(n, -1, -1), x], dim=1) + self.positions(gh, gw)
        n_run = self.spec.feature_layer % (self.spec.layers + 1)
        for layer in self.layers[:n_run]:
            x = layer(x)
        if n_run == self.spec.layers:
            x = self.final_norm(x)
        if self.spec.drop_cls:
            x = x[:, 1:]
        x = self.pixel_shuffle(x.reshape(n, gh, gw, c))  # [N, g', g', C*4]
        x = x.reshape(n, -1, x.shape[-1])
        return self.proj2(self.proj_act(self.proj1(self.proj_norm(x))))

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Load from a state dict with HF InternVL keys, prefixes already normalised to
        ``vision_tower.`` and ``multi_modal_projector.``."""
        m = {
            "patch_embed.weight": "vision_tower.embeddings.patch_embeddings.projection.weight",
            "patch_embed.bias": "vision_tower.embeddings.patch_embeddings.projection.bias",
            "cls_token": "vision_tower.embeddings.cls_token",
            "pos_embed": "vision_tower.embeddings.position_embeddings",
            "proj_norm.weight": "multi_modal_projector.layer_norm.weight",
            "proj_norm.bias": "multi_modal_projector.layer_norm.bias",
            "proj1.weight": "multi_modal_projector.linear_1.weight",
            "proj1.bias": "multi_modal_projector.linear_1.bias",
            "proj2.weight": "multi_modal_projector.linear_2.weight",
            "proj2.bias": "multi_modal_projector.linear_2.bias",
        }
        if not self.spec.mean_pooling:
            m["final_norm.weight"] = "vision_tower.layernorm.weight"
            m["final_norm.bias"] = "vision_tower.layernorm.bias"
        names = {"q_proj": "attention.q_proj", "k_proj": "attention.k_proj",
                 "v_proj": "attention.v_proj", "o_proj": "attention.projection_layer",
                 "q_norm": "attention.q_norm", "k_norm": "attention.k_norm",
                 "norm1": "layernorm_before", "norm2": "layernorm_after",
                 "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
        for i in range(self.spec.layers):
            pre = f"vision_tower.encoder.layer.{i}."
            m[f"layers.{i}.ls1"] = pre + "lambda_1"
            m[f"layers.{i}.ls2"] = pre + "lambda_2"
            for ours, theirs in names.items():
                for p in ("weight", "bias"):
                    m[f"layers.{i}.{ours}.{p}"] = pre + f"{theirs}.{p}"
        sd = split_fused_qkv(sd, self.spec.layers)
        own = self.state_dict()
        missing = []
        with torch.no_grad():
            for ours, t in own.items():
                hf = m.get(ours)
                if hf is not None and hf in sd:
                    t.copy_(sd[hf])
                elif ours.endswith("bias") and ours.split(".")[-2] in ("q_proj", "k_proj",
                                                                      "v_proj"):
                    t.zero_()  # attention_bias=False checkpoints carry no q/k/v bias
                else:
                    missing.append(hf or ours)
        if missing:
            raise KeyError(f"checkpoint lacks vision weights: {missing[:5]} "
                           f"({len(missing)} missing)")


def split_fused_qkv(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """``sd`` with each layer's fused ``attention.qkv`` (the original layout's ``attn.qkv``,
    rows q, then k, then v, each C) as ``q_proj``, ``k_proj``, ``v_proj``, the way
    transformers' conversion script splits it; ``sd`` itself if there is none."""
    pre = "vision_tower.encoder.layer.{}.attention."
    if pre.format(0) + "qkv.weight" not in sd:
        return sd
    out = dict(sd)
    for i in range(layers):
        for p in ("weight", "bias"):
            fused = out.pop(pre.format(i) + f"qkv.{p}", None)
            if fused is not None:
                for name, part in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3, 0)):
                    out[pre.format(i) + f"{name}.{p}"] = part
    return out
