"""Label sets about a clip and a list of images (``MediaItem``) on the built-in InternVL and
Qwen models (``vlmbatch/models/default_model``, ``default_qwen_model``), exact scoring:

- each choice's ``logprobs`` equal transformers' summed token log-likelihoods of the item's
  prompt + that choice alone (one forward over the whole sequence per choice, the clip as
  ``pixel_values_videos`` for Qwen2.5-VL with its ``second_per_grid_ts``, InternVL's frames
  as tiles) within 1e-4, fp32 on CPU;
- the same as scoring each choice alone through our engine (a one-choice label set: its
  tokens see no other choice's), within 1e-5, with the prefix cache on and off and beside a
  yes/no question about the same item.

The clip is made here (lossless FFV1, ``tests/preprocessing/video_clips.py``) and sampled
by the checkpoint's video plan, as ``run`` samples it.
Shown failing once with a fault injected: the continuation's positions one too far
(``choices._continue``: ``pos0 + off + 1``) fails both families against transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import reference_pixels as internvl_pixels
from tests.models.qwen_vl_helpers import reference_pixels as qwen_pixels
from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.engine.records import MediaItem, Request
from vlmbatch.models.paths import DEFAULT_MODEL, DEFAULT_QWEN_MODEL
from vlmbatch.preprocessing.media import PreparedVideo

MODELS = {"internvl": DEFAULT_MODEL, "qwen": DEFAULT_QWEN_MODEL}
# one-token and several-token choices, one the first tokens of another
LABELS = ("circle", "a red circle", "red", "triangle", "no shape at all")
Q = "Which shape is it?"
TOL = 1e-4


def items(engine) -> list[MediaItem]:  # noqa: ANN001
    """A clip of 20 frames sampled as 4 by the checkpoint's plan (``Engine.video_plan``, as
    ``run`` samples it), and a list of two images (clip frames' pixels)."""
    pixels = frames(20, 64, 48)
    clip = engine.video_plan.with_sampling(num_frames=4).prepare(
        make_clip(pixels, FFV1_MKV), 10**9)
    plan = engine.image_plan
    pair = (plan.prepare(pixels[3]), plan.prepare(pixels[11][:, ::-1].copy()))
    return [MediaItem((clip,)), MediaItem(pair)]


def reference_logprob(ref: torch.nn.Module, engine, item: MediaItem,  # noqa: ANN001
                      choice: str, family: str) -> float:
    """transformers' log P(choice | the item's prompt): the sum over the choice's tokens of
    their log-softmax, from one forward over prompt + choice."""
    ours = engine.model
    prompt = ours.prompts.build_parts(Q, item.parts)
    ans = list(ours.prompts.answer_ids(choice))
    ids = torch.tensor([[*prompt.ids, *ans]])
    if family == "internvl":
        tiles = torch.from_numpy(np.concatenate([p.rows for p in item.parts]))
        args: dict = dict(input_ids=ids, pixel_values=internvl_pixels(tiles))
    else:
        spec = ours.spec
        v = spec.vision
        args = dict(input_ids=ids, mm_token_type_ids=(ids == spec.image_token_id).int()
                    + 2 * (ids == spec.video_token_id).int())
        vids = [p for p in item.parts if isinstance(p, PreparedVideo)]
        ims = [p for p in item.parts if not isinstance(p, PreparedVideo)]
        for name, grid, ps in (("pixel_values", "image_grid_thw", ims),
                               ("pixel_values_videos", "video_grid_thw", vids)):
            if ps:
                rows = torch.cat([torch.from_numpy(p.rows) for p in ps])
                args[name] = qwen_pixels(rows, v.mean, v.std)
                args[grid] = torch.tensor([p.grid.dims for p in ps])
        if vids:
            args["second_per_grid_ts"] = torch.tensor([2 / p.fps for p in vids])
    with torch.no_grad():
        lsm = torch.log_softmax(ref(**args).logits[0].double(), -1)
    n = len(prompt.ids)
    return sum(float(lsm[n - 1 + i, t]) for i, t in enumerate(ans))


@pytest.fixture(scope="module", params=list(MODELS))
def built(request: pytest.FixtureRequest):  # noqa: ANN201
    from transformers import AutoModelForImageTextToText, InternVLForConditionalGeneration

    model, family = MODELS[request.param], request.param
    engine = build_engine(ModelConfig(model, "cpu", "float32"), EngineConfig())
    cls = InternVLForConditionalGeneration if family == "internvl" \
        else AutoModelForImageTextToText
    ref = cls.from_pretrained(str(model), dtype=torch.float32).eval()
    return model, family, engine, ref


def test_label_sets_match_transformers(built) -> None:  # noqa: ANN001
    model, family, engine, ref = built
    its = items(engine)
    assert len(its[0].parts[0].seconds) == 4  # type: ignore[attr-defined]
    lengths = [len(engine.model.prompts.answer_ids(c)) for c in LABELS]
    assert min(lengths) == 1 and max(lengths) >= 3  # one-token and several-token choices
    reqs = [Request(i, Q, choices=LABELS) for i in range(len(its))]
    worst = 0.0
    for r, s in zip(reqs, engine.score(its, reqs)):  # type: ignore[arg-type]
        assert s.logprobs is not None and len(s.logprobs) == len(LABELS)
        want = [reference_logprob(ref, engine, its[r.image], c, family) for c in LABELS]
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, want)))
    print(f"{family}: max |logprobs - transformers'| {worst:.1e}")  # pytest -s
    assert worst <= TOL, worst


@pytest.mark.parametrize("cache", [True, False])
def test_a_label_set_equals_each_label_alone(built, cache: bool) -> None:  # noqa: ANN001
    model, family, _, _ = built
    engine = build_engine(ModelConfig(model, "cpu", "float32"),
                          EngineConfig(prefix_cache=cache, block_size=4))
    its = items(engine)
    together = [Request(i, Q, choices=LABELS) for i in range(len(its))] \
        + [Request(i, "Is there a red shape?") for i in range(len(its))]
    got = engine.score(its, together)  # type: ignore[arg-type]
    alone = [Request(i, Q, choices=(c,)) for i in range(len(its)) for c in LABELS]
    each = engine.score(its, alone)  # type: ignore[arg-type]
    for i in range(len(its)):
        sets = got[i].logprobs
        assert sets is not None
        singles = [each[i * len(LABELS) + k].logprobs for k in range(len(LABELS))]
        assert max(abs(a - b[0]) for a, b in zip(sets, singles) if b) <= 1e-5
    yes_no = build_engine(ModelConfig(model, "cpu", "float32"), EngineConfig()).score(
        its, [Request(i, "Is there a red shape?") for i in range(len(its))])  # type: ignore
    for a, b in zip(got[len(its):], yes_no):  # the label sets beside change no yes/no row
        assert abs(a.margin - b.margin) <= 1e-5
