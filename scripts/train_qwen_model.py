"""Train vlmbatch's second built-in model, a small Qwen2.5-VL, on CPU (fixed seed).

The same recipe, data and options as the InternVL one (``scripts/train_default_model.py``,
``docs/models.md``: stage 1 the vision tower alone on shape/colour presence, stage
2a open questions, stage 2b everything, with the match loss; easy-vqa's *train* split and our
scenes), on the real Qwen2.5-VL architecture (transformers' ``Qwen2_5_VLForConditionalGeneration``:
window attention with full-attention blocks, RMSNorm, SwiGLU, 2x2 patch merger, M-RoPE
decoder) at a small size. Images go through the project's own Qwen-VL preprocessing
(``preprocessing/qwen_vl.py``: OpenCV smart resize, uint8 patch rows) and prompts through the
family's prompt builder, so training and serving see the same pixels and ids.

Pixel range 112x112 .. 224x224: an easy-vqa image (64 px) is enlarged to 112 px, 16 image
tokens as the InternVL model's tile; scenes keep their aspect ratio, up to 64 tokens.

It trains our serving modules (``VisionTower``, ``models.decoder.TextDecoder``, equal to
transformers' on the same weights, tested), not transformers' classes: transformers' Qwen
vision attention runs one SDPA call per image and layer on the CPU (64 images: 256 calls, a
vision step 2.5-6.6 s measured), ours one padded call per layer. Weights start from
transformers' initialisation of the same config and are written back into that model's
layout (``save_pretrained``), so the result is an ordinary HF checkpoint. Each step encodes
its images once and writes the features into every question about them; positions are the
prompt builder's M-RoPE positions, continued by the rope delta over the answer.

    python scripts/train_qwen_model.py --out vlmbatch/models/default_qwen_model --minutes 60 ...

(the command ``docs/models.md`` gives). The stage loop is ``train_default_model.train_lm``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.train_default_model import (  # noqa: E402
    AUX,
    answer_and_match,
    attribute_tokens,
    balanced_questions,
    corpus,
    easy_vqa_labels,
    easy_vqa_train,
    pad_batch,
    parse_args,
    scene_target,
    seeded,
    train_lm,
    vision_loop,
    write_training_log,
)
from vlmbatch.cli.bench.shapes import make_questions, make_scene  # noqa: E402
from vlmbatch.models.base import weight_key  # noqa: E402
from vlmbatch.models.decoder import TextDecoder  # noqa: E402
from vlmbatch.models.qwen_vl.family import QwenVL  # noqa: E402
from vlmbatch.models.qwen_vl.positions import Grid, batch_positions, prompt_positions  # noqa: E402
from vlmbatch.models.qwen_vl.prompt import QwenVLPrompts  # noqa: E402
from vlmbatch.models.qwen_vl.random import preprocessor_config  # noqa: E402
from vlmbatch.models.qwen_vl.spec import spec_from_config  # noqa: E402
from vlmbatch.models.qwen_vl.tokenizer import build_tokenizer  # noqa: E402
from vlmbatch.models.qwen_vl.vision import VisionTower  # noqa: E402
from vlmbatch.models.qwen_vl.vision import our_name as vision_name  # noqa: E402
from vlmbatch.preprocessing.qwen_vl import PatchGrid, QwenVLPreprocess  # noqa: E402

PRE = QwenVLPreprocess(patch=14, merge=2, temporal=2, min_pixels=112 * 112,
                       max_pixels=224 * 224)
NORMALISE = QwenVL().normalise_key  # transformers' keys -> the decoder's (``language_model.*``)
# (patch rows uint8, [(question, answer)], aux target, aux mask, grid_thw): the InternVL
# script's item order (its corpus() reads it), the grid last
Item = tuple[np.ndarray, list[tuple[str, str]], np.ndarray, np.ndarray, Grid]


def model_config(tok):  # noqa: ANN001, ANN201
    from transformers import Qwen2_5_VLConfig

    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=96, intermediate_size=256, num_heads=4,
                           out_hidden_size=128, patch_size=PRE.patch, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
                           hidden_act="silu"),
        text_config=dict(vocab_size=len(tok), hidden_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6]},
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.pad_token_id, bos_token_id=None),
        **ids)


def load_data(n_scenes: int, seed: int, colour_pairs: int = 1) -> list[Item]:
    """``Item``s from easy-vqa train and our scenes."""
    rng = np.random.default_rng(seed)
    data: list[Item] = []
    for img, qa in easy_vqa_train():
        im = PRE.prepare(img)
        target, mask = easy_vqa_labels(qa)
        data.append((im.rows, qa + balanced_questions(target, mask, rng, colour_pairs), target,
                     mask, im.grid.dims))  # type: ignore[arg-type]
    for _ in range(n_scenes):
        scene = make_scene(rng)
        im = PRE.prepare(scene.image)
        data.append((im.rows, make_questions(scene, rng, 8), scene_target(scene),
                     np.ones(len(AUX), np.float32), im.grid.dims))  # type: ignore[arg-type]
    return data


class Batcher:
    """Prompt ids exactly as the family's builder makes them, plus the answer and
    ``<|im_end|>``; the token id of each attribute word inside a question."""

    def __init__(self, tok, cfg) -> None:  # noqa: ANN001
        self.tok, self.image = tok, cfg.image_token_id
        self.prompts = QwenVLPrompts(tok, cfg.image_token_id, cfg.vision_start_token_id,
                                     cfg.vision_end_token_id, PRE.merge)
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.attribute = attribute_tokens(tok)

    def sequence(self, grid: Grid, question: str, answer: str) -> tuple[list[int], int]:
        ids = list(self.prompts.build_for_grid(question, PatchGrid(*grid, PRE.merge)).ids)
        return ids + self.tok.encode(answer, add_special_tokens=False) + [self.eos], len(ids)


class Model(torch.nn.Module):
    """The trained pair: our tower and decoder (module docstring)."""

    def __init__(self, hf) -> None:  # noqa: ANN001
        super().__init__()
        spec = spec_from_config(hf.config.to_dict(), preprocessor_config(
            "qwen2_5_vl", PRE.patch, PRE.merge, (PRE.min_pixels, PRE.max_pixels)))
        self.spec, self.hf = spec, [hf]  # a list: not a submodule, its weights not trained
        self.vision, self.text = VisionTower(spec.vision), TextDecoder(spec.text)
        sd = hf.state_dict()
        self.vision.load_hf(sd)
        self.text.load_hf({NORMALISE(k): t for k, t in sd.items()})

    @property
    def config(self):  # noqa: ANN201
        return self.hf[0].config

    def to_hf(self):  # noqa: ANN201
        """transformers' model holding the trained weights (names and shapes mapped back)."""
        hf = self.hf[0]
        ours = {**{("v", k): t for k, t in self.vision.state_dict().items()},
                **{("t", weight_key(k)): t for k, t in self.text.state_dict().items()}}
        sd = {}
        for key, t in hf.state_dict().items():
            name = ("v", vision_name(key)) if vision_name(key) else ("t", NORMALISE(key))
            sd[key] = ours[name].reshape(t.shape)
        hf.load_state_dict(sd)
        return hf


def image_features(model: Model, items: list) -> list[torch.Tensor]:
    """Each item's merged image tokens [tokens, D_text], one tower call."""
    out = model.vision(torch.from_numpy(np.concatenate([it[0] for it in items])),
                       [it[4] for it in items])
    return list(out.embeds.split([PatchGrid(*it[4], PRE.merge).tokens for it in items]))


def aux_loss(aux_head, feats: list[torch.Tensor], items: list) -> torch.Tensor:  # noqa: ANN001
    """Shape/colour presence from each image's mean token (the throw-away head)."""
    pooled = torch.stack([f.mean(0) for f in feats])
    target = torch.from_numpy(np.stack([it[2] for it in items]))
    mask = torch.from_numpy(np.stack([it[3] for it in items]))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(aux_head(pooled), target,
                                                               reduction="none")
    return (bce * mask).sum() / mask.sum().clamp(min=1)


def train_step(model, aux_head, batcher: Batcher, items: list, q_per_image: int,  # noqa: ANN001
               rng: random.Random, match, match_layer: int,  # noqa: ANN001
               buckets: int = 1) -> tuple[torch.Tensor, ...]:
    """(answer cross-entropy, aux loss, match loss) of one step: ``train_default_model``'s
    losses on the Qwen model, length-bucketed the same way."""
    feats = image_features(model, items)
    aux = aux_loss(aux_head, feats, items)
    seqs, owner = [], []
    for j, (_, qa, _, _, grid) in enumerate(items):
        for q, a in rng.sample(qa, min(q_per_image, len(qa))):
            seqs.append(batcher.sequence(grid, q[0].upper() + q[1:] if rng.random() < 0.5
                                         else q, a))
            owner.append(j)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    ce = n_ce = match_sum = n_match = 0
    for chunk in np.array_split(np.array(order), buckets):
        if len(chunk):
            c, n, m, w = lm_losses(model, batcher, [seqs[i] for i in chunk],
                                   [owner[i] for i in chunk], feats, items, match, match_layer)
            ce, n_ce, match_sum, n_match = ce + c, n_ce + n, match_sum + m, n_match + w
    return ce / max(n_ce, 1), aux, match_sum / max(n_match, 1)


def lm_losses(model: Model, batcher: Batcher, seqs: list, owner: list[int],
              feats: list[torch.Tensor], items: list, match, match_layer: int,  # noqa: ANN001
              ) -> tuple[torch.Tensor, float, torch.Tensor, float]:
    """(sum, count) of the answer cross-entropy and of the match loss, one right-padded
    batch; each row's image tokens replaced by its image's features."""
    ids, labels, attn = pad_batch(seqs, batcher.tok.pad_token_id)
    positions = [prompt_positions(s, batcher.image, items[j][4], PRE.merge)[0]
                 for (s, _), j in zip(seqs, owner)]
    x = model.text.embed_tokens(ids)
    x = x.masked_scatter((ids == batcher.image)[..., None], torch.cat([feats[j] for j in owner]))
    hidden = decoder_hidden(model.text, x, batch_positions(positions, ids.shape[1]), attn > 0,
                            match_layer)
    logits = model.text.lm_head(model.text.norm(hidden[-1]))
    target = torch.from_numpy(np.stack([items[j][2] for j in owner]))
    weight = torch.from_numpy(np.stack([items[j][3] for j in owner]))
    return answer_and_match(logits, hidden[0], ids, labels, batcher.attribute, target, weight,
                            match)


def decoder_hidden(text: TextDecoder, x: torch.Tensor, positions: torch.Tensor,
                   valid: torch.Tensor, match_layer: int) -> list[torch.Tensor]:
    """Hidden states [B, T, D] after ``match_layer`` layers and after the last, causal
    attention over the real tokens (right padding: a pad query still sees real keys)."""
    t = x.shape[1]
    pos = torch.arange(t)
    mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
    cos, sin = text.rotary(positions, x.dtype)
    out = []
    for i, layer in enumerate(text.layers):
        x, _ = layer(x, cos, sin, mask[:, None], None)
        if i + 1 == match_layer:
            out.append(x)
    return [*out, x]


def pretrain_vision(model: Model, aux_head, data: list, seconds: float,  # noqa: ANN001
                    lr: float, rng: random.Random, batch: int = 64) -> tuple[int, float]:
    """Stage 1: the vision tower (merger included) + aux head only."""
    return vision_loop(list(model.vision.parameters()) + list(aux_head.parameters()),
                       lambda items: aux_loss(aux_head, image_features(model, items), items),
                       data, seconds, lr, rng, batch)


def save(model: Model, tok, out: Path) -> None:  # noqa: ANN001
    out.mkdir(parents=True, exist_ok=True)
    model.to_hf().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(
        preprocessor_config("qwen2_5_vl", PRE.patch, PRE.merge,
                            (PRE.min_pixels, PRE.max_pixels)), indent=2))


def new_or_saved_model(args: argparse.Namespace, data: list):  # noqa: ANN201
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    if args.init is not None:
        args.vision_minutes = args.open_minutes = 0.0
        return (AutoTokenizer.from_pretrained(str(args.init)),
                Model(Qwen2_5_VLForConditionalGeneration.from_pretrained(str(args.init))))
    tok = build_tokenizer(corpus(data), vocab_size=512)
    return tok, Model(Qwen2_5_VLForConditionalGeneration(model_config(tok)))


def main() -> None:
    args = parse_args()
    if args.reduced_scenes:
        raise SystemExit("--reduced-scenes is InternVL tiling; Qwen-VL has none")
    seeded(args)
    t0 = time.time()
    data = load_data(args.scenes, args.seed, args.colour_pairs)
    if args.yes_no_only:
        data = [(d[0], [qa for qa in d[1] if qa[1] in ("yes", "no")], *d[2:]) for d in data]
    tok, model = new_or_saved_model(args, data)
    model.train()
    batcher = Batcher(tok, model.hf[0].config)
    log = [f"data: {len(data)} images, {sum(len(d[1]) for d in data)} questions; vocab "
           f"{len(tok)}; params {sum(p.numel() for p in model.parameters())}; prep "
           f"{time.time() - t0:.0f}s"]
    print(log[-1], flush=True)
    aux_head = torch.nn.Linear(model.spec.text.hidden, len(AUX))
    t1 = time.time()
    n1, aux1 = pretrain_vision(model, aux_head, data, args.vision_minutes * 60, args.vision_lr,
                               random.Random(args.seed))
    log.append(f"stage 1 (vision tower + aux head): {n1} steps of 64 images in "
               f"{time.time() - t1:.0f}s, aux loss {aux1:.4f}")
    print(log[-1], flush=True)
    stages = (("2a", [(d[0], [qa for qa in d[1] if qa[1] not in ("yes", "no")], *d[2:])
                      for d in data], args.open_minutes),
              ("2b", data, args.minutes - args.vision_minutes - args.open_minutes))
    steps = [train_lm(model, aux_head, batcher, [d for d in stage if d[1]], minutes * 60, args,
                      log, tok, name, step_fn=train_step, save_fn=save)
             for name, stage, minutes in stages]
    save(model, tok, args.out)
    log.append(f"done: stage 2a {steps[0]} steps, stage 2b {steps[1]} steps")
    write_training_log(args, log)
    print(log[-1])


if __name__ == "__main__":
    main()
