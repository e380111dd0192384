"""Items with a clip or several images through ``TorchEngine.score`` (``MediaItem``):
P(yes) margins equal transformers' logits on the same ids and rows (1e-4; the reference as
in ``tests/models/test_qwen_vl_media.py``), K questions about an item prefill its prefix
once, the prefix cache keys every part by content, and a clip's frame groups are encoded
once each across overlapping windows and repeated items (``engine/features.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.media_helpers import clip, random_frames
from tests.models.qwen_vl_helpers import reference_pixels, save_engine_checkpoint
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import MediaItem, Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import LoadedModel
from vlmbatch.preprocessing.media import MediaPart, PreparedVideo
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import prepare_qwen_vl

KINDS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
QUESTIONS = ["Is there a cat?", "Is it raining?", "Is the sky blue?", "Any dogs?"]


@dataclass
class Models:
    path: Path
    ours: LoadedModel
    ref: torch.nn.Module


@pytest.fixture(scope="module")
def all_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Models]:
    from transformers import AutoModelForImageTextToText

    out = {}
    for kind in KINDS:
        path = save_engine_checkpoint(kind, tmp_path_factory.mktemp(kind))
        ref = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
        out[kind] = Models(path, load_model(path), ref)
    return out


@pytest.fixture(params=KINDS)
def models(request: pytest.FixtureRequest, all_models: dict[str, Models]) -> Models:
    return all_models[request.param]


def frames_clip(m: Models, frames: np.ndarray, first: int = 0) -> PreparedVideo:
    p = m.ours.spec.vision.patch  # type: ignore[attr-defined]
    return clip(frames, p, 2, 2, src_fps=4.0, indices=[8 * (first + k) for k in range(len(frames))],
                fps=0.5)


def a_clip(m: Models, n: int = 6, seed: int = 0) -> PreparedVideo:
    side = 2 * m.ours.spec.vision.patch  # type: ignore[attr-defined]
    return frames_clip(m, random_frames(n, 2 * side, 3 * side, seed))


def an_image(m: Models, w: int, h: int, seed: int) -> PreparedImage:
    rng = np.random.default_rng(seed)
    return prepare_qwen_vl(rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
                           m.ours.spec.preprocess)  # type: ignore[attr-defined]


def reference_margin(m: Models, engine: TorchEngine, parts: list[MediaPart],
                     question: str) -> float:
    spec = m.ours.spec
    v = spec.vision  # type: ignore[attr-defined]
    prompt = m.ours.prompts.build_parts(question, parts)
    ids = torch.tensor([prompt.ids])
    args: dict = dict(input_ids=ids, mm_token_type_ids=(ids == spec.image_token_id).int()
                      + 2 * (ids == spec.video_token_id).int())  # type: ignore[attr-defined]
    ims = [p for p in parts if isinstance(p, PreparedImage)]
    vids = [p for p in parts if isinstance(p, PreparedVideo)]
    for name, grid, ps in (("pixel_values", "image_grid_thw", ims),
                           ("pixel_values_videos", "video_grid_thw", vids)):
        if ps:
            rows = torch.cat([torch.from_numpy(p.rows) for p in ps])
            args[name] = reference_pixels(rows, v.mean, v.std)
            args[grid] = torch.tensor([p.grid.dims for p in ps])
    if vids and spec.model_type == "qwen2_5_vl":
        args["second_per_grid_ts"] = torch.tensor([2 / p.fps for p in vids])
    with torch.no_grad():
        logits = m.ref(**args).logits[0, -1]
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    return float(logits[yes].logsumexp(-1) - logits[no].logsumexp(-1))


@pytest.mark.parametrize("rows", ["off", "on"])
def test_margins_match_transformers(models: Models, rows: str) -> None:
    """A clip, two images, and an image-clip-image item, each asked two questions in one
    call: question rows (packing) and phases both."""
    m = models
    items = [MediaItem((a_clip(m),)),
             MediaItem((an_image(m, 200, 90, 1), an_image(m, 60, 170, 2))),
             MediaItem((an_image(m, 90, 90, 3), a_clip(m, 4, 4), an_image(m, 120, 60, 5)))]
    engine = TorchEngine(m.ours, EngineConfig(question_rows=rows))
    requests = [Request(i, q) for i in range(len(items)) for q in QUESTIONS[:2]]
    for r, s in zip(requests, engine.score(items, requests)):  # type: ignore[arg-type]
        want = reference_margin(m, engine, list(items[r.image].parts), r.question)
        assert abs(s.margin - want) <= 1e-4


def test_k_questions_prefill_the_prefix_once(models: Models) -> None:
    """K questions about one clip: its prefix (through the clip's end marker) is prefilled
    once, each question only its own tokens; a second call prefills no clip token and
    encodes nothing."""
    m = models
    item = MediaItem((a_clip(m, 8, 7),))
    engine = TorchEngine(m.ours, EngineConfig())
    prompts = [m.ours.prompts.build_parts(q, item.parts) for q in QUESTIONS]
    engine.score([item], [Request(0, q) for q in QUESTIONS])  # type: ignore[list-item]
    shared = prompts[0].prefix_len
    own = sum(len(p.ids) - shared for p in prompts)
    assert engine.stats.prefill_tokens <= shared + own  # not K * shared
    assert engine.stats.image_tokens_prefilled == prompts[0].image_len
    tiles = engine.stats.vision_tiles
    engine.score([item], [Request(0, "Is anyone there?")])  # type: ignore[list-item]
    assert engine.stats.image_tokens_prefilled == prompts[0].image_len
    assert engine.stats.vision_tiles == tiles


def test_items_sharing_the_first_part_share_only_what_precedes_the_second(
        models: Models) -> None:
    m = models
    first = an_image(m, 200, 90, 1)
    a = MediaItem((first, an_image(m, 60, 170, 2)))
    b = MediaItem((first, an_image(m, 60, 170, 3)))
    engine = TorchEngine(m.ours, EngineConfig(block_size=4, question_rows="off"))
    engine.score([a], [Request(0, QUESTIONS[0])])  # type: ignore[list-item]
    before = engine.stats.prefill_tokens
    engine.score([b], [Request(0, QUESTIONS[0])])  # type: ignore[list-item]
    prompt = m.ours.prompts.build_parts(QUESTIONS[0], b.parts)
    second = prompt.parts[1][0][0]  # the second image's first token
    reused = len(prompt.ids) - (engine.stats.prefill_tokens - before)
    if m.ours.spec.model_type == "qwen3_5":  # linear layers resume only at a whole cached
        assert reused == 0  # prefix's state snapshot (docs/hybrid_cache.md)
        return
    assert second // 4 * 4 - 4 <= reused <= second  # the blocks before the second image


def test_frame_groups_are_encoded_once(models: Models) -> None:
    """Two windows of one clip overlapping by half (frames 0-7 and 4-11: 4 groups each, 2
    shared) encode 6 groups; the same window asked again (prefix cache off) encodes none;
    and the clip's logits through per-group encoding equal transformers' (above)."""
    m = models
    side = 2 * m.ours.spec.vision.patch  # type: ignore[attr-defined]
    frames = random_frames(12, 2 * side, 2 * side, 9)
    first, second = frames_clip(m, frames[:8]), frames_clip(m, frames[4:], first=4)
    assert first.group_hashes[2:] == second.group_hashes[:2]
    engine = TorchEngine(m.ours, EngineConfig(prefix_cache=False))
    engine.score([MediaItem((first,)), MediaItem((second,))],  # type: ignore[list-item]
                 [Request(0, QUESTIONS[0]), Request(1, QUESTIONS[0])])
    assert engine.runner.features.encoded == 6
    assert engine.runner.features.hits == 2  # the shared groups
    engine.score([MediaItem((second,))], [Request(0, QUESTIONS[1])])  # type: ignore[list-item]
    assert engine.runner.features.encoded == 6
