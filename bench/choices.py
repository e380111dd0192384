"""Label-set QPM (issue 27): vlmbatch's exact multi-token scoring against a batched
transformers peer, side by side in one process, on InternVL (the built-in model by default).

- vlmbatch: ``TorchEngine.score`` with one label-set question per image; the prompt and its
  image are prefilled once, every choice is a continuation after the prompt's KV
  (``engine/choices.py``). A fresh engine (empty prefix cache) each round.
- transformers (what a competent user writes, SDPA): every prompt + choice as one full
  sequence, ``--batch`` sequences per forward, left-padded with positions from the mask, the
  image's features computed once per image and reused for all its choices
  (``mm_encoder_outputs``, as ``cli/bench/baseline.py``'s ``Batched``), the logits kept only
  for the choices' positions; log P(choice) = the sum of its tokens' log-softmax.

Rows: 2, 4 and 8 choices, single-token (colour words, each one token) and multi-token
("a red shape": 3 tokens each). Both sides get the same prepared images (preprocessing is
not timed on either side) and answer the same questions; QPM counts questions (one label
set each), the best of ``--rounds``. The two sides' log-likelihoods are compared (fp32: to
1e-3; half precision: labels only) and the ratio at 4 choices checked against
``--min-ratio`` (3x, issue 27); a failed check exits 1 (``bench/checks.py``).

    python bench/choices.py [--images 32] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checks import Checks  # noqa: E402
from vlmbatch.cli.bench.baseline import can_pass_features, load_reference  # noqa: E402
from vlmbatch.cli.embed_eval import COLOURS  # noqa: E402
from vlmbatch.cli.evaluate import easy_vqa_items  # noqa: E402
from vlmbatch.engine.config import DTYPES, EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.engine.loading import image_plan_for, load_model, torch_dtype  # noqa: E402
from vlmbatch.engine.records import Request  # noqa: E402
from vlmbatch.engine.torch_engine import TorchEngine  # noqa: E402
from vlmbatch.models.paths import DEFAULT_MODEL  # noqa: E402
from vlmbatch.preprocessing.decode import decode  # noqa: E402
from vlmbatch.preprocessing.prepare import PreparedImage  # noqa: E402
from vlmbatch.preprocessing.reference import pixel_values  # noqa: E402

QUESTION = "What color is the shape?"


def label_sets(n: int) -> dict[str, tuple[str, ...]]:
    """The single- and multi-token label sets of ``n`` choices."""
    return {"single-token": COLOURS[:n], "multi-token": tuple(f"a {c} shape" for c in
                                                              COLOURS[:n])}


def ours(model: Any, images: list[PreparedImage], choices: tuple[str, ...],
         group: int) -> list[tuple[float, ...]]:
    """Every image's choices' log-likelihoods, ``group`` images per engine call."""
    engine = TorchEngine(model, EngineConfig())
    out: list[tuple[float, ...]] = []
    for lo in range(0, len(images), group):
        ims = images[lo: lo + group]
        scores = engine.score(ims, [Request(i, QUESTION, choices=choices)
                                    for i in range(len(ims))])
        out += [s.logprobs for s in scores if s.logprobs is not None]
    return out


class Peer:
    """The transformers peer (module docstring): full sequences, ``batch`` per forward."""

    def __init__(self, ref: Any, model: Any, batch: int) -> None:
        self.ref, self.model, self.batch = ref, model, batch
        self.reuse = can_pass_features(ref)
        self.pad = model.tokenizer.pad_token_id or 0

    @torch.inference_mode()
    def score(self, images: list[PreparedImage], choices: tuple[str, ...]
              ) -> list[tuple[float, ...]]:
        prompts = self.model.prompts
        ids = [prompts.answer_ids(c) for c in choices]
        seqs = [(k, c) for k in range(len(images)) for c in range(len(choices))]
        feats: dict[int, torch.Tensor] = {}
        total = np.zeros((len(images), len(choices)))
        for lo in range(0, len(seqs), self.batch):
            chunk = seqs[lo: lo + self.batch]
            rows = [(*prompts.build(QUESTION, images[k]).ids, *ids[c]) for k, c in chunk]
            keep = max(len(ids[c]) for _, c in chunk) + 1
            logits = self.ref(**self._inputs(rows, keep), **self._vision(
                [k for k, _ in chunk], images, feats)).logits  # [B, keep, V]
            lsm = torch.log_softmax(logits.float(), -1)
            for j, (k, c) in enumerate(chunk):
                n = len(ids[c])
                at = torch.arange(keep - 1 - n, keep - 1)
                total[k, c] = float(lsm[j, at, torch.tensor(ids[c])].sum())
        return [tuple(r) for r in total.tolist()]

    def _inputs(self, rows: list[tuple[int, ...]], keep: int) -> dict[str, Any]:
        t = max(map(len, rows))
        ids = torch.tensor([[self.pad] * (t - len(r)) + list(r) for r in rows])
        mask = torch.tensor([[0] * (t - len(r)) + [1] * len(r) for r in rows])
        dev = self.ref.device
        return dict(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(dev), logits_to_keep=keep)

    def _vision(self, which: list[int], images: list[PreparedImage],
                feats: dict[int, torch.Tensor]) -> dict[str, Any]:
        """The chunk's image inputs: features made once per image (reused), or pixels."""
        spec, dev, dt = self.model.spec, self.ref.device, self.ref.dtype

        def pixels(k: int) -> torch.Tensor:
            return pixel_values(images[k].rows, spec.vision.mean, spec.vision.std)

        if not self.reuse:
            return {"pixel_values": torch.cat([pixels(k) for k in which]).to(dev, dt)}
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        new = sorted(set(which) - feats.keys())
        if new:
            f = self.ref.get_image_features(pixel_values=torch.cat(
                [pixels(k) for k in new]).to(dev, dt)).pooler_output
            feats.update(zip(new, f.split([len(images[k].rows) for k in new])))
        return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(
            pooler_output=torch.cat([feats[k] for k in which]))}}


def timed(fn: Any, rounds: int) -> tuple[float, Any]:
    """(best seconds of ``rounds``, the last result) after one untimed warm-up call."""
    fn()
    best, out = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--images", type=int, default=32, help="easy-vqa test images")
    ap.add_argument("--group", type=int, default=16, help="images per engine call")
    ap.add_argument("--batch", type=int, default=16, help="the peer's sequences per forward")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--min-ratio", type=float, default=3.0, help="checked at 4 choices")
    args = ap.parse_args()
    dtype = torch_dtype(args.dtype)
    model = load_model(args.model, args.device, dtype)
    plan = image_plan_for(model.family, model.spec, ModelConfig(path=args.model))
    images = [plan.prepare(decode(Path(it.image).read_bytes()))
              for it in easy_vqa_items("test")[: args.images]]
    peer = Peer(load_reference(args.model, args.device, dtype), model, args.batch)
    checks = Checks()
    print(f"{len(images)} images, one label-set question each; {args.device} {args.dtype}; "
          f"peer batch {args.batch}, features reused: {peer.reuse}")
    print(f"{'choices':>7} {'kind':<12} {'vlmbatch QPM':>12} {'transformers QPM':>16} "
          f"{'ratio':>6} {'max |dlogp|':>11}  checks")
    for n in (2, 4, 8):
        for kind, choices in label_sets(n).items():
            t_ours, a = timed(lambda: ours(model, images, choices, args.group), args.rounds)
            t_peer, b = timed(lambda: peer.score(images, choices), args.rounds)
            diff = float(np.abs(np.array(a) - np.array(b)).max())
            same = [int(np.argmax(x)) for x in a] == [int(np.argmax(x)) for x in b]
            ok = (diff <= 1e-3 if args.dtype == "float32" else True) and same
            words = [checks.verdict(ok, f"{n} {kind} choices: log-likelihoods agree "
                                    f"(max diff {diff:.2e}, labels same: {same})")]
            ratio = t_peer / t_ours
            if n == 4:
                words.append(checks.verdict(ratio >= args.min_ratio, f"{n} {kind} choices: "
                                            f"ratio {ratio:.2f} >= {args.min_ratio}"))
            qpm = 60 * len(images)
            print(f"{n:>7} {kind:<12} {qpm / t_ours:>12.0f} {qpm / t_peer:>16.0f} "
                  f"{ratio:>5.2f}x {diff:>11.2e}  {' '.join(words)}")
    checks.exit()


if __name__ == "__main__":
    main()
