"""Train vlmbatch's built-in embedding model: a short contrastive (InfoNCE) stage on top of the
built-in model, on CPU (fixed seed, <= 30 minutes on 2 cores).

Data: easy-vqa's *train* images whose questions settle their colour and shape (3,542 of
4,000; never its test split), captioned from those labels ("a red circle"), and our own shape
scenes (``vlmbatch/cli/bench/shapes.py``: 1-3 shapes, many sizes and aspect ratios, 1-7 tiles),
captioned from theirs ("a blue triangle and a red circle"). Images are tiled by the serving
plan (reduced tiling), prompts built and pooled by the serving code
(``InternVLPrompts.embed``, ``engine.pooling.pool_range``) and run through the serving
modules (our ``VisionEncoder`` and ``TextDecoder``), so training computes exactly the vectors
``vlmbatch embed`` serves: an image's is the mean of the last hidden states over
``<img>``..``</img>``, a caption's over its tokens, then L2.

Only the top ``--train-layers`` decoder layers and the final norm are trained. The vision
encoder, the token embeddings and the lower layers stay as they are (the image features
already separate colour and shape: image -> image top-1 0.994 before training), so every
input's hidden states below the trained layers are computed once, before training, and a
step runs the trained layers only (on 2 shared cores a full-model step took 3-8 s).

Loss per step (a batch of images and their distinct captions), summed over the Matryoshka
sizes ``--dims`` (each: the first N components, re-normalised):

- text <-> image InfoNCE at temperature ``--tau``, every image of a caption a positive;
- image <-> image supervised contrastive (``--image-weight``): images with the same caption
  are positives, so neighbours in image space share colour and shape.

The learning rate warms up over the first 5% of the time budget, then follows a cosine to 0
at its end (by wall clock, so a slow machine gets the same schedule in fewer steps). The
saved folder is the built-in model's checkpoint with the trained weights and jina's
declarations in config.json (``single_vector_pool_strategy: "mean"``, ``matryoshka_dims``),
so ``vlmbatch embed`` knows it is an embedding model; its log holds the command, the losses
and the retrieval figures before and after (``cli/embed_eval.py``). ``docs/models.md``, "The
built-in embedding model".
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.train_default_model import seeded  # noqa: E402
from vlmbatch.cli.bench.shapes import make_scene  # noqa: E402
from vlmbatch.cli.embed_eval import caption, evaluate_retrieval, labels  # noqa: E402
from vlmbatch.engine.build import build_engine  # noqa: E402
from vlmbatch.engine.config import EmbedConfig, EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.engine.embed import EmbedHandle  # noqa: E402
from vlmbatch.engine.loading import image_plan_for, load_model  # noqa: E402
from vlmbatch.engine.pooling import pool_range  # noqa: E402
from vlmbatch.models.base import weight_key  # noqa: E402
from vlmbatch.models.decoder import TextDecoder  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402
from vlmbatch.preprocessing.decode import decode  # noqa: E402

Example = tuple[torch.Tensor, tuple[int, int], str]  # (hidden [T, D] below the trained
# layers, pooled range, caption)


def scene_caption(scene) -> str:  # noqa: ANN001  (a scripts.shapes.Scene)
    """The scene's shapes as one caption, in a canonical order."""
    return " and ".join(sorted({caption(s.color, s.kind) for s in scene.shapes}))


def load_images(n_scenes: int, seed: int, plan) -> list[tuple[np.ndarray, str]]:  # noqa: ANN001
    """(tiles [N, S, S, 3] uint8, caption) per training image."""
    import easy_vqa

    paths = easy_vqa.get_train_image_paths()
    data = [(plan.prepare(decode(Path(paths[i]).read_bytes())).tiles, caption(c, s))
            for i, (c, s) in labels("train").items()]
    rng = np.random.default_rng(seed)
    for _ in range(n_scenes):
        scene = make_scene(rng)
        data.append((plan.prepare(scene.image).tiles, scene_caption(scene)))
    return data


def run_layers(llm: TextDecoder, x: torch.Tensor, lengths: torch.Tensor, first: int,
               last: int) -> torch.Tensor:
    """Decoder layers ``[first, last)`` over right-padded ``x [B, T, D]`` (positions from 0,
    causal, padding masked), as ``TextDecoder.prefill_hidden`` runs them."""
    b, t, _ = x.shape
    pos = torch.arange(t)
    mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, :] < lengths[:, None])[:, None]
    cos, sin = llm.rotary(pos[None].expand(b, t), x.dtype)
    for layer in llm.layers[first:last]:
        x, _ = layer(x, cos, sin, mask[:, None])
    return x


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T_i, D] rows -> ([B, T, D] right-padded with zeros, lengths [B])."""
    t = max(len(r) for r in rows)
    out = rows[0].new_zeros((len(rows), t, rows[0].shape[1]))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, torch.tensor([len(r) for r in rows])


@torch.no_grad()
def frozen_states(loaded, images: list[tuple[np.ndarray, str]], below: int,  # noqa: ANN001
                  chunk: int = 128) -> tuple[list[Example], dict[str, Example]]:
    """Every image's and caption's hidden states after the first ``below`` layers (image
    prompts cut after ``</img>``: nothing later changes an image-mean vector), in chunks."""
    llm, prompts, vision = loaded.llm, loaded.prompts, loaded.vision
    out: list[Example] = []
    for i in range(0, len(images), chunk):
        part = images[i: i + chunk]
        feats = vision(torch.from_numpy(np.concatenate([t for t, _ in part])))
        rows, ranges, first = [], [], 0
        for tiles, _ in part:
            p = prompts.build_for_tiles("", len(tiles))  # ids through </img> as embed's
            g = pool_range(p, "image-mean")
            x = llm.embed_tokens(torch.tensor(p.ids[: g.end]))
            x[p.image_start: p.image_start + p.image_len] = feats[first: first + len(
                tiles)].flatten(0, 1)
            first += len(tiles)
            rows.append(x)
            ranges.append((g.start, g.end))
        h, n = _pad(rows)
        h = run_layers(llm, h, n, 0, below)
        out += [(h[j, : n[j]].clone(), ranges[j], c) for j, (_, c) in enumerate(part)]
    texts = sorted({c for _, c in images})
    rows = [llm.embed_tokens(torch.tensor(prompts.embed(t, None).ids)) for t in texts]
    h, n = _pad(rows)
    h = run_layers(llm, h, n, 0, below)
    captions = {t: (h[j, : n[j]].clone(), (0, int(n[j])), t) for j, t in enumerate(texts)}
    return out, captions


def pooled(llm: TextDecoder, batch: list[Example], below: int) -> torch.Tensor:
    """The trained layers and the final norm over ``batch``, each row's range averaged:
    [B, D], not normalised."""
    h, n = _pad([x for x, _, _ in batch])
    h = llm.norm(run_layers(llm, h, n, below, llm.spec.layers))
    pos = torch.arange(h.shape[1])
    ranges = torch.tensor([g for _, g, _ in batch])
    keep = ((pos[None] >= ranges[:, :1]) & (pos[None] < ranges[:, 1:])).float()
    return (h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)


def losses(img: torch.Tensor, txt: torch.Tensor, owner: torch.Tensor, dims: list[int],
           tau: float, image_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(text<->image, image<->image) losses summed over ``dims``; ``owner[b]``: the index of
    image b's caption among ``txt``'s rows."""
    pos = owner[:, None] == torch.arange(len(txt))[None]  # [B, C]
    same = owner[:, None] == owner[None]  # [B, B]
    eye = torch.eye(len(img), dtype=torch.bool)
    ti = ii = img.new_zeros(())
    for d in dims:
        a, b = F.normalize(img[:, :d], dim=-1), F.normalize(txt[:, :d], dim=-1)
        logits = a @ b.T / tau
        ti = ti + F.cross_entropy(logits, owner) + _multi_positive(logits.T, pos.T)
        s = (a @ a.T / tau).masked_fill(eye, -1e4)
        has = (same & ~eye).any(1)
        if image_weight and has.any():
            ii = ii + _multi_positive(s[has], (same & ~eye)[has])
    return ti, image_weight * ii


def _multi_positive(logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -mean log-softmax over each row's positives."""
    logp = logits.log_softmax(1)
    return (-(logp * pos).sum(1) / pos.sum(1)).mean()


def step(llm: TextDecoder, items: list[Example], captions: dict[str, Example], below: int,
         args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    names = sorted({c for _, _, c in items})
    img = pooled(llm, items, below)
    txt = pooled(llm, [captions[c] for c in names], below)
    owner = torch.tensor([names.index(c) for _, _, c in items])
    return losses(img, txt, owner, [int(d) for d in args.dims.split(",")], args.tau,
                  args.image_weight)


def train(llm: TextDecoder, data: list[Example], captions: dict[str, Example], below: int,
          args: argparse.Namespace, log: list[str]) -> int:
    params = [p for layer in llm.layers[below:] for p in layer.parameters()]
    params += list(llm.norm.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    rng = random.Random(args.seed)
    budget, start, n, ema = args.minutes * 60, time.time(), 0, None
    while (frac := (time.time() - start) / budget) < 1:
        lr = args.lr * min(1.0, frac / 0.05) * 0.5 * (1 + np.cos(np.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        ti, ii = step(llm, rng.sample(data, args.batch), captions, below, args)
        opt.zero_grad(set_to_none=True)
        (ti + ii).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        now = np.array([ti.item(), ii.item()])
        ema = now if ema is None else 0.95 * ema + 0.05 * now
        n += 1
        if n % 50 == 0:
            log.append(f"step {n} t={time.time() - start:.0f}s lr={lr:.2e} "
                       f"text-image={ema[0]:.4f} image-image={ema[1]:.4f}")
            print(log[-1], flush=True)
    return n


def save(llm: TextDecoder, init: Path, out: Path, dims: str) -> None:
    """The init checkpoint with the decoder's weights replaced by ``llm``'s (HF layout),
    plus the embedding declarations in config.json."""
    from transformers import InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(str(init))
    ours = {weight_key(k): v for k, v in llm.state_dict().items()}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            key = name.removeprefix("model.")
            if key.startswith("language_model.") and key in ours:
                t.copy_(ours[key])
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "preprocessor_config.json"):
        (out / f).write_bytes((init / f).read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    cfg["single_vector_pool_strategy"] = "mean"  # jina's name for the image-span rule
    cfg["matryoshka_dims"] = [int(d) for d in dims.split(",")]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--init", type=Path, default=DEFAULT_MODEL, help="the model to start from")
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget")
    ap.add_argument("--scenes", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64, help="images per step")
    ap.add_argument("--train-layers", type=int, default=2, help="top decoder layers trained")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--image-weight", type=float, default=0.5)
    ap.add_argument("--dims", default="32,64,128", help="Matryoshka sizes (the last: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args()


def evaluate(path: Path, log: list[str], name: str) -> None:
    r = evaluate_retrieval(EmbedHandle(build_engine(ModelConfig(path), EngineConfig()),
                                    EmbedConfig(pooling="image-mean")))
    p = r.precision_at_10
    lines = [f"{name}: text->image precision@10 min {min(p.values()):.3f} mean "
             f"{np.mean(list(p.values())):.3f}; image->image top-1 {r.image_top1:.4f}",
             *r.text().splitlines()]
    log.extend(lines)
    print("\n".join(lines), flush=True)


def main() -> None:
    args = parse_args()
    seeded(args)
    t0 = time.time()
    loaded = load_model(args.init)
    below = loaded.spec.text.layers - args.train_layers
    images = load_images(args.scenes, args.seed, image_plan_for(loaded.family, loaded.spec,
                                                                ModelConfig()))
    data, captions = frozen_states(loaded, images, below)
    log = ["command: " + " ".join(sys.argv),
           f"data: {len(data)} images ({len(data) - args.scenes} easy-vqa train, "
           f"{args.scenes} scenes), {len(captions)} distinct captions; layers {below}.."
           f"{loaded.spec.text.layers - 1} trained; prep {time.time() - t0:.0f}s"]
    print(log[-1], flush=True)
    evaluate(args.init, log, "before (the built-in model)")
    llm = loaded.llm.train()
    t1 = time.time()
    n = train(llm, data, captions, below, args, log)
    log.append(f"trained {n} steps of {args.batch} images in {time.time() - t1:.0f}s")
    args.out.mkdir(parents=True, exist_ok=True)
    save(llm.eval(), args.init, args.out, args.dims)
    evaluate(args.out, log, "after")
    log.append(f"total wall clock {time.time() - t0:.0f}s")
    (args.out / "training_log.txt").write_text("\n".join(log) + "\n")
    print(log[-1])


if __name__ == "__main__":
    main()
