"""Train vlmbatch's built-in default model on CPU (fixed seed, <= 60 min on 2 cores).

The model is a small but real InternVL (HF-native ``InternVLForConditionalGeneration``:
InternViT-style encoder, pixel shuffle + MLP projector, Qwen2 language model) with 112 px
tiles (16 image tokens per tile). Data: easy-vqa's *train* split (never its test split) and our
own shape scenes (``vlmbatch/cli/bench/shapes.py``: counts, positions, several tiles per image).

Training uses the project's own preprocessing (OpenCV decode/resize, InternVL tiling) so
training and serving see the same pixels. Each step encodes a batch of images once and asks
each up to ``--q-per-image`` questions; the loss is next-token cross-entropy on the answer and
its ``<|im_end|>``, plus two auxiliary losses whose heads are thrown away (the saved model is
a plain InternVL):

- *aux*: the image's shapes and colours from the mean-pooled vision features (stage 1 trains
  the encoder on it alone);
- *match*: at each shape or colour word of a question (" red", " circle"), whether the image
  has that attribute, read by a linear head off the language model's hidden state after
  ``--match-layer`` layers. A yes/no question needs the question's word bound to the image:
  the answer's colour word ("red") and the question's (" red") are different tokens, and
  without this loss the model sat at the question-only prior for ~1,000 steps and learnt
  colour binding only partly in 60 minutes (0.71 on colour questions whose answer depends on
  a match). With it, a 14-minute one-thread run on easy-vqa alone reached 0.99 on them.

``--multi-frame N`` adds N clips and image lists of scenes (``vlmbatch/cli/bench/clip_scenes.py``:
presence questions, *yes* iff some frame or image has the attribute), prepared and prompted
as serving does them (the checkpoint's video and image plans, ``PromptBuilder.build_parts``).

See ``docs/models.md``, "The built-in model", for the committed command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmbatch.cli.bench.shapes import COLORS, SHAPES, Scene, make_questions, make_scene  # noqa: E402
from vlmbatch.models.internvl.tokenizer import build_tokenizer  # noqa: E402
from vlmbatch.preprocessing.decode import decode  # noqa: E402
from vlmbatch.preprocessing.prepare import TilingConfig, prepare  # noqa: E402

# Auxiliary targets: presence of each shape and colour, predicted by a throw-away linear head
# on the mean-pooled vision features (the head is not saved). Trained end to end only, the
# encoder learnt colour but not shape within the time budget (shape questions stayed at the
# always-"no" rate after 1,000 steps); so stage 1 trains the encoder alone on these targets
# (cheap steps, no LLM), with layer scale 1.0 (0.1 learnt shape far more slowly), and stage 2
# trains everything on the answers with the auxiliary loss kept on.
AUX = list(SHAPES) + list(COLORS)

MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, as InternVL uses
STD = (0.229, 0.224, 0.225)
TILING = TilingConfig(tile_size=112, min_tiles=1, max_tiles=6, use_thumbnail=True)
REDUCED = dataclasses.replace(TILING, mode="reduced")


def model_config(vocab_size: int, image_token_id: int, eos_id: int, pad_id: int):  # noqa: ANN201
    from transformers import InternVLConfig

    return InternVLConfig(
        vision_config=dict(
            hidden_size=96, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384,
            image_size=TILING.tile_size, patch_size=14, norm_type="layer_norm",
            layer_scale_init_value=1.0, use_mean_pooling=True),
        text_config=dict(
            model_type="qwen2", vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
            max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
            eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None),
        image_token_id=image_token_id,
        image_seq_length=(TILING.tile_size // 14) ** 2 // 4,
        downsample_ratio=0.5,
        tie_word_embeddings=True,
    )


def easy_vqa_labels(qa: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(targets [len(AUX)], mask [len(AUX)]) for an easy-vqa image: one shape, one colour,
    read from the answers of its open questions ("what shape ...", "what color ...")."""
    target, mask = np.zeros(len(AUX), np.float32), np.zeros(len(AUX), np.float32)
    for _, a in qa:
        if a in SHAPES:
            target[:len(SHAPES)] = 0
            target[AUX.index(a)] = 1
            mask[:len(SHAPES)] = 1
        elif a in COLORS:
            target[len(SHAPES):] = 0
            target[AUX.index(a)] = 1
            mask[len(SHAPES):] = 1
    return target, mask


YES_NO_FORMS = [("is there a {} in the image?", False), ("does the image contain a {}?", False),
                ("is a {} present?", False), ("is there not a {}?", True),
                ("does the image not contain a {}?", True), ("is no {} present?", True)]


def balanced_questions(target: np.ndarray, mask: np.ndarray, rng: np.random.Generator,
                       colour_pairs: int = 1) -> list[tuple[str, str]]:
    """Extra yes/no questions for an easy-vqa *train* image, from its own labels: for its
    shape one question whose answer is yes and one whose answer is no, and ``colour_pairs``
    such pairs for its colour (each with another wrong colour). In easy-vqa's own questions
    "is there a <colour> shape?" is "no" 7 times in 8, which left the model at that prior;
    balanced pairs make the image decide."""
    out = []
    for names, offset, suffix, pairs in ((list(SHAPES), 0, "", 1),
                                         (list(COLORS), len(SHAPES), " shape", colour_pairs)):
        if not mask[offset]:
            continue
        true = names[int(np.argmax(target[offset: offset + len(names)]))]
        others = rng.permutation([n for n in names if n != true])
        for k in range(pairs):
            for thing, present in ((true, True), (str(others[k % len(others)]), False)):
                form, negated = YES_NO_FORMS[int(rng.integers(len(YES_NO_FORMS)))]
                out.append((form.format(thing + suffix), "yes" if present != negated else "no"))
    return out


def easy_vqa_train() -> list[tuple[np.ndarray, list[tuple[str, str]]]]:
    """easy-vqa's *train* split: (decoded image, its (question, answer) pairs) in image
    order."""
    import easy_vqa  # the training data, read here only

    texts, answers, image_ids = easy_vqa.get_train_questions()
    paths = easy_vqa.get_train_image_paths()
    by_image: dict[int, list[tuple[str, str]]] = {}
    for q, a, i in zip(texts, answers, image_ids):
        by_image.setdefault(i, []).append((q, a))
    return [(decode(Path(paths[i]).read_bytes()), qa) for i, qa in sorted(by_image.items())]


def load_data(n_scenes: int, seed: int, colour_pairs: int = 1,
              reduced_scenes: bool = False) -> list[tuple]:
    """[(tiles [N,S,S,3] uint8, [(question, answer), ...], aux target, aux mask), ...] from
    easy-vqa train and our scenes. ``reduced_scenes`` adds every scene a second time with
    reduced (letterboxed) tiling, so the model also learns to read padded tiles."""
    rng = np.random.default_rng(seed)
    data = []
    for img, qa in easy_vqa_train():
        target, mask = easy_vqa_labels(qa)
        data.append((prepare(img, TILING).tiles,
                     qa + balanced_questions(target, mask, rng, colour_pairs), target, mask))
    for _ in range(n_scenes):
        scene = make_scene(rng)
        target = scene_target(scene)
        qa = make_questions(scene, rng, 8)
        ones = np.ones(len(AUX), np.float32)
        data.append((prepare(scene.image, TILING).tiles, qa, target, ones))
        if reduced_scenes:
            data.append((prepare(scene.image, REDUCED).tiles, qa, target, ones))
    return data


def multi_frame_data(checkpoint: Path, n: int, seed: int) -> list[tuple]:
    """``n`` items, two clips (2-8 frames, sampled by the checkpoint's video plan from a
    lossless clip as ``vlmbatch run`` samples it) per list of 2-3 images (the image plan's
    tiles): [(tiles, [(question, answer)...], target over all frames, ones, parts)], the
    built question and three random ones (``clip_scenes.make_case``)."""
    from vlmbatch.cli.bench.clip_scenes import encode_clip, make_case
    from vlmbatch.engine.config import ModelConfig
    from vlmbatch.engine.loading import image_plan_for, load_model, video_plan_for
    lm = load_model(checkpoint)
    images, video = image_plan_for(lm.family, lm.spec, ModelConfig()), video_plan_for(lm.spec)
    assert video is not None
    rng = np.random.default_rng([seed, 44])
    out = []
    for i in range(n):
        clip = i % 3 != 2
        frames = int(rng.integers(2, 9)) if clip else int(rng.integers(2, 4))
        case = make_case(rng, frames, same_size=clip)
        if clip:
            parts = (video.with_sampling(num_frames=frames).prepare(encode_clip(case), 10**9),)
        else:
            parts = tuple(images.prepare(sc.image) for sc in case.scenes)
        tiles = parts[0].rows if clip else np.concatenate([p.rows for p in parts])
        qa = [(a.text[0].lower() + a.text[1:], "yes" if t else "no") for a, t in case.questions]
        target = np.max([scene_target(sc) for sc in case.scenes], axis=0)
        out.append((tiles, qa, target, np.ones(len(AUX), np.float32), parts))
    return out


def scene_target(scene: Scene) -> np.ndarray:
    """[len(AUX)] float32: 1 for each shape kind and colour the scene has, else 0."""
    return np.array([any(s.kind == k or s.color == k for s in scene.shapes) for k in AUX],
                    np.float32)


def corpus(data: list) -> list[str]:
    lines = [q for _, qa, *_ in data for q, _ in qa] + [a for _, qa, *_ in data for _, a in qa]
    lines += ["<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_start|>system\n"] * 200
    lines += ["Yes", "No", "YES", "NO", "yes", "no"] * 200
    lines += [q[0].upper() + q[1:] for _, qa, *_ in data[:2000] for q, _ in qa]
    return lines


def normalise(tiles: np.ndarray) -> torch.Tensor:
    """[N,S,S,3] uint8 -> [N,3,S,S] float32 normalised."""
    x = torch.from_numpy(tiles).permute(0, 3, 1, 2).float().div_(255)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (x - mean) / std


def attribute_tokens(tok) -> dict[int, int]:  # noqa: ANN001
    """Token id of each attribute word as it appears inside a question -> index in AUX."""
    out = {}
    for k, word in enumerate(AUX):
        ids = tok.encode(" " + word, add_special_tokens=False)
        if len(ids) == 1:
            out[ids[0]] = k
    return out


class Batcher:
    """Builds (pixel_values, input_ids, labels, tile owner) for a set of images."""

    def __init__(self, tok, tokens_per_tile: int) -> None:  # noqa: ANN001
        self.tok = tok
        self.tpt = tokens_per_tile
        self.img_start = tok.convert_tokens_to_ids("<img>")
        self.img_end = tok.convert_tokens_to_ids("</img>")
        self.ctx = tok.convert_tokens_to_ids("<IMG_CONTEXT>")
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        pre = tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}],
            tokenize=False, add_generation_prompt=True)
        self.head, self.tail = pre.split("<IMG_CONTEXT>")[0], pre.split("<IMG_CONTEXT>")[1]
        self.tail_pre, self.tail_post = self.tail.split("Q")
        self.attribute = attribute_tokens(tok)
        self.prompts = None  # the model's PromptBuilder, for items with ``parts``
        self.freeze_vision = False  # encode tiles without gradients (``--freeze-vision``)

    def set_prompts(self, path: Path) -> None:
        """Prompts of several parts as the engine writes them, from the checkpoint at
        ``path`` (its tokenizer is this batcher's)."""
        from vlmbatch.engine.loading import load_model

        self.prompts = load_model(path).prompts

    def sequence(self, n_tiles: int, question: str, answer: str,
                 parts: tuple | None = None) -> tuple[list[int], int]:
        """(ids, prompt length): one image of ``n_tiles`` tiles, or ``parts`` (a clip or
        several images: ``MediaPart`` records) written by the serving prompt builder
        (``set_prompts``), each followed by the answer and ``<|im_end|>``."""
        enc = self.tok.encode
        if parts is not None:
            ids = list(self.prompts.build_parts(question, parts).ids)
            return ids + enc(answer, add_special_tokens=False) + [self.eos], len(ids)
        ids = enc(self.head, add_special_tokens=False)
        ids += [self.img_start] + [self.ctx] * (self.tpt * n_tiles) + [self.img_end]
        ids += enc(self.tail_pre + question + self.tail_post, add_special_tokens=False)
        n_prompt = len(ids)
        ids += enc(answer, add_special_tokens=False) + [self.eos]
        return ids, n_prompt


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=45.0, help="wall-clock training budget")
    ap.add_argument("--scenes", type=int, default=4000)
    ap.add_argument("--images-per-step", type=int, default=24)
    ap.add_argument("--q-per-image", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux-weight", type=float, default=1.0)
    ap.add_argument("--vision-minutes", type=float, default=10.0,
                    help="stage 1 (vision encoder alone), part of --minutes")
    ap.add_argument("--vision-lr", type=float, default=2e-3)
    ap.add_argument("--open-minutes", type=float, default=4.0,
                    help="stage 2a (open questions only), part of --minutes")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this saved model (stage 2b only, for --minutes)")
    ap.add_argument("--colour-pairs", type=int, default=1,
                    help="balanced colour yes/no pairs added per easy-vqa train image")
    ap.add_argument("--reduced-scenes", action="store_true",
                    help="also train on every scene tiled in reduced (letterboxed) mode")
    ap.add_argument("--yes-no-only", action="store_true",
                    help="stage 2b on yes/no questions only")
    ap.add_argument("--warmup", type=int, default=100, help="stage 2 warm-up steps")
    ap.add_argument("--match-weight", type=float, default=1.0,
                    help="weight of the stage-2 match loss: at each shape or colour word of a "
                         "question, whether the image has it, read off --match-layer")
    ap.add_argument("--match-layer", type=int, default=2)
    ap.add_argument("--buckets", type=int, default=3,
                    help="length buckets the language-model batch is split into")
    ap.add_argument("--multi-frame", type=int, default=0,
                    help="clips and image lists of scenes added (two clips per list)")
    ap.add_argument("--multi-seed", type=int, default=1)
    ap.add_argument("--freeze-vision", action="store_true",
                    help="stage 2b: the vision tower and projector not trained (fine-tuning "
                         "the language model to read several frames; the aux loss then "
                         "trains its throw-away head only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args()


def new_or_saved_model(args: argparse.Namespace, data: list):  # noqa: ANN201
    """(tokenizer, model, config): a fresh model with a tokenizer trained on ``data``, or
    the model at ``--init`` (then only stage 2b runs)."""
    from transformers import InternVLForConditionalGeneration

    if args.init is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.init))
        model = InternVLForConditionalGeneration.from_pretrained(str(args.init))
        args.vision_minutes = args.open_minutes = 0.0
        return tok, model, model.config
    tok = build_tokenizer(corpus(data), vocab_size=512)
    cfg = model_config(len(tok), tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
                       tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    return tok, InternVLForConditionalGeneration(cfg), cfg


def seeded(args: argparse.Namespace) -> None:
    """The fixed seed (torch and random) and thread count every training script starts with."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)


def write_training_log(args: argparse.Namespace, log: list[str]) -> None:
    """``OUT/training_log.txt``: the ``--init`` model's log, then this run's command and
    lines (committed beside the weights)."""
    previous = (args.init / "training_log.txt").read_text() if args.init else ""
    (args.out / "training_log.txt").write_text(
        previous + "command: " + " ".join(sys.argv) + "\n" + "\n".join(log) + "\n")


def main() -> None:
    args = parse_args()
    seeded(args)
    t0 = time.time()
    data = load_data(args.scenes, args.seed, args.colour_pairs, args.reduced_scenes)
    if args.yes_no_only:
        data = [(d[0], [qa for qa in d[1] if qa[1] in ("yes", "no")], d[2], d[3]) for d in data]
        data = [d for d in data if d[1]]
    tok, model, cfg = new_or_saved_model(args, data)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    batcher = Batcher(tok, cfg.image_seq_length)
    batcher.freeze_vision = args.freeze_vision
    if args.multi_frame:
        if args.init is None:
            raise SystemExit("--multi-frame needs --init (the prompts of a saved model)")
        batcher.set_prompts(args.init)
        data += multi_frame_data(args.init, args.multi_frame, args.multi_seed)
    log_lines = [f"data: {len(data)} images, {sum(len(d[1]) for d in data)} questions; "
                 f"vocab {len(tok)}; params {n_params}; prep {time.time() - t0:.0f}s"]
    print(log_lines[-1], flush=True)

    aux_head = torch.nn.Linear(cfg.vision_config.hidden_size, len(AUX))
    t1 = time.time()
    n1, aux1 = pretrain_vision(model, aux_head, data, args.vision_minutes * 60, args.vision_lr,
                               rng=random.Random(args.seed))
    log_lines.append(f"stage 1 (vision encoder + aux head): {n1} steps of 64 images in "
                     f"{time.time() - t1:.0f}s, aux loss {aux1:.4f}")
    print(log_lines[-1], flush=True)

    # Stage 2a: open questions only ("what color is the shape?" -> "red"), whose answers can
    # only come from the image. Trained on the full mix straight away, the language model
    # settled on the question-only prior (87.5% on colour questions, 66.7% on shape ones:
    # always "no") and did not read the image tokens within 1,000 steps; this stage makes it.
    open_data = [(d[0], [qa for qa in d[1] if qa[1] not in ("yes", "no")], d[2], d[3])
                 for d in data]
    open_data = [d for d in open_data if d[1]]
    n2a = train_lm(model, aux_head, batcher, open_data, args.open_minutes * 60, args, log_lines,
                   tok, stage="2a")
    n2b = train_lm(model, aux_head, batcher, data,
                   (args.minutes - args.vision_minutes - args.open_minutes) * 60, args,
                   log_lines, tok, stage="2b")
    save(model, tok, args.out)
    log_lines.append(f"done: stage 2a {n2a} steps, stage 2b {n2b} steps")
    write_training_log(args, log_lines)
    print(log_lines[-1])


def train_lm(model, aux_head, batcher, data: list, budget: float,  # noqa: ANN001
             args: argparse.Namespace, log_lines: list[str], tok, stage: str,  # noqa: ANN001
             step_fn=None, save_fn=None) -> int:  # noqa: ANN001
    """Stage 2: everything, on answer tokens (+ the auxiliary loss); cosine LR with warm-up.
    ``step_fn``/``save_fn``: another family's ``train_step``/``save`` (the Qwen-VL script's);
    InternVL's by default."""
    step_fn, save_fn = step_fn or train_step, save_fn or save
    match = torch.nn.Linear(model.config.text_config.hidden_size, 1)
    params = list(model.parameters()) + list(aux_head.parameters()) + list(match.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = args.warmup
    start = time.time()
    step = 0
    ema = ema_aux = ema_match = None
    order = list(range(len(data)))
    rng = random.Random(args.seed)
    pos = len(order)
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        if pos + args.images_per_step > len(order):
            rng.shuffle(order)
            pos = 0
        chosen = order[pos: pos + args.images_per_step]
        pos += args.images_per_step
        loss, aux, match_loss = step_fn(
            model, aux_head, batcher, [data[i] for i in chosen], args.q_per_image, rng,
            match, args.match_layer, args.buckets)
        opt.zero_grad(set_to_none=True)
        (loss + args.aux_weight * aux + args.match_weight * match_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        ema_aux = aux.item() if ema_aux is None else 0.98 * ema_aux + 0.02 * aux.item()
        ema_match = (match_loss.item() if ema_match is None
                     else 0.98 * ema_match + 0.02 * match_loss.item())
        step += 1
        if step % 50 == 0:
            log_lines.append(f"stage {stage} step {step} t={time.time() - start:.0f}s "
                             f"lr={lr:.2e} loss={ema:.4f} aux={ema_aux:.4f} "
                             f"match={ema_match:.4f}")
            print(log_lines[-1], flush=True)
        if step % 500 == 0:
            save_fn(model, tok, args.out)
    return step


def pretrain_vision(model, aux_head, data: list, seconds: float, lr: float,  # noqa: ANN001
                    rng: random.Random, batch: int = 64) -> tuple[int, float]:
    """Stage 1: vision tower + aux head only, on the last tile of each image."""
    vit = model.model.vision_tower

    def loss_of(items: list) -> torch.Tensor:
        x = normalise(np.stack([d[0][-1] for d in items]))
        target = torch.from_numpy(np.stack([d[2] for d in items]))
        mask = torch.from_numpy(np.stack([d[3] for d in items]))
        pooled = vit(pixel_values=x).last_hidden_state[:, 1:].mean(1)
        return (torch.nn.functional.binary_cross_entropy_with_logits(
            aux_head(pooled), target, reduction="none") * mask).sum() / mask.sum()

    return vision_loop(list(vit.parameters()) + list(aux_head.parameters()), loss_of, data,
                       seconds, lr, rng, batch)


def vision_loop(params: list, loss_of, data: list, seconds: float, lr: float,  # noqa: ANN001
                rng: random.Random, batch: int) -> tuple[int, float]:
    """Stage 1's loop: AdamW on ``params`` over ``loss_of(batch of items)`` for
    ``seconds``, warm-up then cosine; (steps, last EMA of the loss). Shared by the
    families' scripts."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    start, step, ema = time.time(), 0, None
    while time.time() - start < seconds:
        frac = (time.time() - start) / seconds
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + np.cos(np.pi * frac))
        loss = loss_of(rng.sample(data, batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
    return step, float(ema or 0.0)


def save(model, tok, out: Path) -> None:  # noqa: ANN001
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))


def train_step(model, aux_head, batcher: Batcher, items: list, q_per_image: int,  # noqa: ANN001
               rng: random.Random, match, match_layer: int,  # noqa: ANN001
               buckets: int = 1) -> tuple[torch.Tensor, ...]:
    tiles = np.concatenate([d[0] for d in items])
    pixel_values = normalise(tiles)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not batcher.freeze_vision):
        out = model.model.get_image_features(pixel_values=pixel_values)
    feats = out.pooler_output  # [tiles, 16, D]
    # aux: the last tile of each image (the thumbnail, or the only tile), mean over patches
    last = torch.tensor(np.cumsum([len(d[0]) for d in items]) - 1)
    pooled = out.last_hidden_state[last, 1:].mean(1)  # [images, C]
    target = torch.from_numpy(np.stack([d[2] for d in items]))
    target_mask = torch.from_numpy(np.stack([d[3] for d in items]))
    # a multi-frame item's (5th element: its parts) target is over all its frames: the match
    # loss's, not the aux loss's (which reads the last tile alone)
    single = torch.tensor([[float(len(d) < 5)] for d in items])
    aux = (torch.nn.functional.binary_cross_entropy_with_logits(
        aux_head(pooled), target, reduction="none") * target_mask * single).sum() / (
        (target_mask * single).sum().clamp(min=1))
    seqs, prompts, img_feats, owner = [], [], [], []
    first = 0
    for j, (t, qa, *rest) in enumerate(items):
        n = len(t)
        f = feats[first: first + n].reshape(-1, feats.shape[-1])
        first += n
        parts = rest[2] if len(rest) > 2 else None
        for q, a in rng.sample(qa, min(q_per_image, len(qa))):
            if rng.random() < 0.5:
                q = q[0].upper() + q[1:]
            ids, n_prompt = batcher.sequence(n, q, a, parts)
            seqs.append(ids)
            prompts.append(n_prompt)
            img_feats.append(f)
            owner.append(j)
    # The language model runs on length buckets (scenes have up to 7 tiles, easy-vqa images
    # one), so short prompts are not padded to the longest (3 buckets: ~1.5x more steps in the
    # committed run); each loss is a sum over the buckets divided by its total count, i.e. the
    # same mean as one padded batch.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    ce = n_ce = match_sum = n_match = 0
    for chunk in np.array_split(np.array(order), buckets):
        if not len(chunk):
            continue
        own = [owner[i] for i in chunk]
        c, n, m, w = _lm_losses(model, batcher, [seqs[i] for i in chunk],
                                [prompts[i] for i in chunk], [img_feats[i] for i in chunk],
                                target[own], target_mask[own], match, match_layer)
        ce, n_ce, match_sum, n_match = ce + c, n_ce + n, match_sum + m, n_match + w
    return ce / max(n_ce, 1), aux, match_sum / max(n_match, 1)


def _lm_losses(model, batcher: Batcher, seqs: list[list[int]], prompts: list[int],  # noqa: ANN001
               img_feats: list[torch.Tensor], target: torch.Tensor, target_mask: torch.Tensor,
               match, match_layer: int,  # noqa: ANN001
               ) -> tuple[torch.Tensor, float, torch.Tensor, float]:
    """(sum, count) of the answer cross-entropy, then of the match loss, for one padded batch
    of sequences; ``target``/``target_mask`` [len(seqs), len(AUX)] per sequence."""
    input_ids, labels, attn = pad_batch(list(zip(seqs, prompts)), batcher.tok.pad_token_id)
    embeds = model.model.get_input_embeddings()(input_ids)
    mask = (input_ids == batcher.ctx).unsqueeze(-1)
    embeds = embeds.masked_scatter(mask, torch.cat(img_feats))
    out = model(inputs_embeds=embeds, attention_mask=attn, output_hidden_states=True)
    return answer_and_match(out.logits, out.hidden_states[match_layer], input_ids, labels,
                            batcher.attribute, target, target_mask, match)


def pad_batch(seqs: list[tuple[list[int], int]], pad: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, attention mask), each [B, T], right-padded, of (sequence, prompt length)
    pairs: labels are the tokens after the prompt, -100 elsewhere."""
    t = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    labels = torch.full((len(seqs), t), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, (s, p) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, p: len(s)] = torch.tensor(s[p:])
        attn[i, : len(s)] = 1
    return ids, labels, attn


def answer_and_match(logits: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor,
                     labels: torch.Tensor, attribute: dict[int, int], target: torch.Tensor,
                     weight: torch.Tensor, match,  # noqa: ANN001
                     ) -> tuple[torch.Tensor, float, torch.Tensor, float]:
    """(sum, count) of the answer cross-entropy (next-token, ``labels`` -100 elsewhere), then
    of the match loss: at each attribute word of a question (``attribute``: token -> AUX
    index), whether the image has it (``target``/``weight`` [B, len(AUX)]), read by ``match``
    off ``hidden`` [B, T, D]. Shared by the families' scripts."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    shifted = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), shifted.reshape(-1),
        ignore_index=-100, reduction="sum")
    attr = torch.full_like(input_ids, -1)
    for token, k in attribute.items():
        attr[input_ids == token] = k
    row, col = (attr >= 0).nonzero(as_tuple=True)
    k = attr[row, col]
    logit = match(hidden[row, col]).squeeze(-1)
    w = weight[row, k]
    match_sum = (bce(logit, target[row, k], reduction="none") * w).sum()
    return ce, float((shifted != -100).sum()), match_sum, float(w.sum())


def preprocessor_config() -> dict:
    """HF image-processor settings matching TILING (GotOcr2 processor, as InternVL-hf uses)."""
    return {
        "image_processor_type": "GotOcr2ImageProcessor",
        "crop_to_patches": True,
        "min_patches": TILING.min_tiles,
        "max_patches": TILING.max_tiles,
        "size": {"height": TILING.tile_size, "width": TILING.tile_size},
        "image_mean": list(MEAN),
        "image_std": list(STD),
        "do_normalize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_resize": True,
        "resample": 3,
    }


if __name__ == "__main__":
    main()
