"""How far ``--resize reference`` moves P(yes) from the default ``--resize opencv``.

Both modes answer every yes/no question of easy-vqa's *test* split (7,136; ``--limit`` fewer)
through the drive loop, as ``vlmbatch eval`` does, side by side in one process on the built-in
Qwen2.5-VL model (``--model``). easy-vqa's 64 px images are upscaled to 112 px by its
``min_pixels``, where OpenCV's INTER_CUBIC and transformers' antialiased torchvision bicubic
differ most. Prints, over the questions: median, p99 and max |dP(yes)| between the modes, the
answers that flip, each mode's accuracy; then the question moved most, with P(yes) from
transformers itself (``AutoModelForImageTextToText`` on the pixels of
``Qwen2VLImageProcessor``, its torchvision backend, which ``reference`` should equal; and on
those of its ``pil`` backend, what transformers gives without torchvision, which
``--resize pillow`` gives).
Counts and probabilities, not timings: the figures do not depend on the machine's load.

    pip install --no-deps --target /tmp/tv torchvision==0.28.*   # not beside our CPU torch
    PYTHONPATH=/tmp/tv python bench/resize_shift.py   # figures: docs/figures.md#resize-shift
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# transformers' P(yes) needs its torchvision-backend processor: torchvision on PYTHONPATH, its
# Python imported first with the fake kernels of its (CUDA) compiled ops skipped, as
# tests/conftest.py does (PyPI's Linux build cannot load them beside our CPU torch)
if importlib.util.find_spec("torchvision") is not None:
    with mock.patch("torch.library.register_fake", lambda *a, **k: (lambda f: f)):
        import torchvision  # noqa: F401

from bench.hf_baseline import _p_yes  # noqa: E402
from bench.hf_qwen import load_qwen_reference  # noqa: E402

from vlmbatch.cli.evaluate import EvalSet, easy_vqa_set  # noqa: E402
from vlmbatch.engine.base import Engine  # noqa: E402
from vlmbatch.engine.build import build_engine  # noqa: E402
from vlmbatch.engine.config import EngineConfig, ModelConfig  # noqa: E402
from vlmbatch.engine.scoring import AnswerTokens  # noqa: E402
from vlmbatch.models.paths import DEFAULT_QWEN_MODEL  # noqa: E402
from vlmbatch.pipeline.config import PrepareOptions  # noqa: E402
from vlmbatch.pipeline.drive import drive, groups_of  # noqa: E402
from vlmbatch.pipeline.task import AnswerTask  # noqa: E402
from vlmbatch.preprocessing.qwen_vl import PatchGrid  # noqa: E402

Key = tuple[str, str]  # (image id, question id)


def answer_all(engine: Engine, data: EvalSet) -> dict[Key, tuple[float, bool]]:
    """(image, question) -> (P(yes), answered right), every question of ``data``."""
    out: dict[Key, tuple[float, bool]] = {}
    for _, results in drive(AnswerTask(), engine, groups_of(data.items, 16),
                            PrepareOptions(threads=0)):
        for a in (a for per_item in results for a in per_item):
            assert a.p_yes is not None, a.error
            key = (a.image_id, a.question_id)
            out[key] = (a.p_yes, a.answer == data.expected[key])
    return out


def transformers_p_yes(model_dir: Path, engine: Engine, image: str, question: str,
                       backend: str) -> float:
    """P(yes) of one question from transformers' own model and image processor, its
    ``torchvision`` backend (``Qwen2VLImageProcessor``) or its ``pil`` one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if backend == "torchvision":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor,
        )
    loaded = engine.model  # type: ignore[attr-defined]
    spec, p = loaded.spec, loaded.spec.preprocess
    cls = Qwen2VLImageProcessor if backend == "torchvision" else Qwen2VLImageProcessorPil
    proc = cls(patch_size=p.patch, merge_size=p.merge,
                                 temporal_patch_size=p.temporal, min_pixels=p.min_pixels,
                                 max_pixels=p.max_pixels, image_mean=list(spec.vision.mean),
                                 image_std=list(spec.vision.std))
    px = proc(images=[Image.open(image).convert("RGB")], return_tensors="pt")
    thw = tuple(int(x) for x in px["image_grid_thw"][0])
    ids = torch.tensor([loaded.prompts.build_for_grid(
        question, PatchGrid(*thw, spec.vision.merge)).ids])
    words = EngineConfig()
    answers = AnswerTokens.from_words(loaded.tokenizer, words.yes_words, words.no_words)
    ref = load_qwen_reference(model_dir, "cpu", torch.float32)
    with torch.inference_mode():
        logits = ref(input_ids=ids, pixel_values=px["pixel_values"],
                     mm_token_type_ids=(ids == spec.image_token_id).int(),
                     image_grid_thw=torch.tensor([thw])).logits[:, -1]
    return _p_yes(logits, list(answers.yes_ids), list(answers.no_ids))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_QWEN_MODEL)
    ap.add_argument("--limit", type=int, default=None, help="questions (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    data = easy_vqa_set("test", args.limit)
    runs, engines = {}, {}
    for mode in ("opencv", "reference"):
        engines[mode] = build_engine(ModelConfig(path=args.model, resize=mode), EngineConfig(),
                                     args.threads)
        runs[mode] = answer_all(engines[mode], data)
    keys = sorted(runs["opencv"])
    p = {m: np.array([runs[m][k][0] for k in keys]) for m in runs}
    d = np.abs(p["reference"] - p["opencv"])
    print(f"{len(keys)} questions, easy-vqa test, {args.model}")
    print(f"|dP(yes)| reference vs opencv: median {np.median(d):.2e}  "
          f"p99 {np.quantile(d, 0.99):.2e}  max {d.max():.4f}")
    flips = int(((p["opencv"] >= 0.5) != (p["reference"] >= 0.5)).sum())
    print(f"answers that flip at 0.5: {flips}")
    for m in runs:
        right = sum(ok for _, ok in runs[m].values())
        print(f"accuracy --resize {m}: {right / len(keys):.4f} ({right}/{len(keys)})")
    worst = keys[int(d.argmax())]
    item = next(i for i in data.items if i.id == worst[0])
    q = next(q for q in item.questions if q.id == worst[1])
    hf = {b: transformers_p_yes(args.model, engines["reference"], str(item.image), q.text, b)
          for b in ("torchvision", "pil")}
    print(f"moved most: image {worst[0]} {q.text!r}: P(yes) transformers {hf['torchvision']:.4f} "
          f"(its pil backend {hf['pil']:.4f}), reference {runs['reference'][worst][0]:.4f}, "
          f"opencv {runs['opencv'][worst][0]:.4f}")


if __name__ == "__main__":
    main()
