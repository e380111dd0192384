"""Qwen-VL prompts with a clip or several images against transformers 5.25: our prompt
(``build_parts``), our tower, the embeddings written into each part's runs, our M-RoPE
positions and ``prefill``, against ``...ForConditionalGeneration.forward`` of the same random
checkpoint (every weight perturbed: ``random.py``) given our ids, ``mm_token_type_ids``
(image 1, video 2), the same uint8 rows normalised the processor's way as
``pixel_values_videos`` / ``pixel_values`` with their grids, and for Qwen2.5-VL
``second_per_grid_ts`` = 2 / the sampling fps as its processor computes it. Max |logit
difference| <= 1e-4 (fp32, CPU). The fault tests show the comparison catches a wrong time
position and frames out of order. The rows' layout is checked against the video processor's
own reshape (restated here: its module needs torchvision, which the project does not ship).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.media_helpers import clip, random_frames, video_rows
from tests.models.qwen_vl_helpers import reference_pixels, save_engine_checkpoint
from vlmbatch.models.base import Prompt
from vlmbatch.models.qwen_vl.load import QwenVLModel, load_qwen_vl
from vlmbatch.models.qwen_vl.prompt import QwenVLPrompts
from vlmbatch.models.registry import family_for
from vlmbatch.preprocessing.media import MediaPart, PreparedVideo
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.preprocessing.qwen_vl import prepare_qwen_vl

TOL = 1e-4
KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
QUESTION = "Is there a cat in the video?"


@dataclasses.dataclass
class Setup:
    ref: torch.nn.Module
    ours: QwenVLModel
    prompts: QwenVLPrompts


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Setup]:
    from transformers import AutoModelForImageTextToText

    out = {}
    for kind in KINDS:
        path = save_engine_checkpoint(kind, Path(tmp_path_factory.mktemp(kind)))
        family, config = family_for(path)
        spec = family.read_spec(path, config)
        prompts = family.prompt_builder(family.load_tokenizer(path), spec)
        assert isinstance(prompts, QwenVLPrompts)
        ref = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
        out[kind] = Setup(ref, load_qwen_vl(path), prompts)
    return out


@pytest.fixture(params=KINDS)
def setup(request: pytest.FixtureRequest, setups: dict[str, Setup]) -> Setup:
    return setups[request.param]


def patch(s: Setup) -> int:
    return s.ours.spec.vision.patch


def a_clip(s: Setup, frames: int = 6, h: int = 2, w: int = 3, fps: float = 0.5,
           seed: int = 0) -> PreparedVideo:
    """``frames`` random frames of h x w merge units, sampled every 2 s of a 4 fps clip
    (fps 0.5: Qwen2.5-VL's time step is then 2 / 0.5 * tokens_per_second)."""
    side = patch(s) * 2
    return clip(random_frames(frames, h * side, w * side, seed), patch(s), 2, 2, src_fps=4.0,
                indices=[int(8 * k) for k in range(frames)], fps=fps)


def an_image(s: Setup, w: int, h: int, seed: int) -> PreparedImage:
    rng = np.random.default_rng(seed)
    return prepare_qwen_vl(rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
                           s.ours.spec.preprocess)


def our_logits(s: Setup, prompt: Prompt, parts: list[MediaPart]) -> torch.Tensor:
    m = s.ours
    with torch.no_grad():
        vis = m.vision(torch.cat([torch.from_numpy(p.rows) for p in parts]),
                       [p.grid.dims for p in parts])
        x = m.text.embed_tokens(torch.tensor([prompt.ids]))
    mask = torch.zeros(len(prompt.ids), dtype=torch.bool)
    for runs in prompt.parts:
        for start, n in runs:
            mask[start: start + n] = True
    x[0, mask] = vis.embeds  # the parts' runs in order = the tower's output order
    from vlmbatch.models.base import DeepStack
    deep = DeepStack(mask[None], vis.deepstack) if vis.deepstack else None
    assert prompt.positions is not None
    with torch.no_grad():
        got, _ = m.text.prefill(x, torch.tensor([len(prompt.ids)]),
                                positions=prompt.positions[:, None], deepstack=deep)
    return got[0]


def reference_logits(s: Setup, prompt: Prompt, parts: list[MediaPart],
                     fps: float | None = None) -> torch.Tensor:
    v = s.ours.spec.vision
    ids = torch.tensor([prompt.ids])
    kind = ((ids == s.prompts.markers.image).int()
            + 2 * (ids == s.ours.spec.video_token_id).int())
    args: dict = dict(input_ids=ids, mm_token_type_ids=kind)
    images = [p for p in parts if isinstance(p, PreparedImage)]
    videos = [p for p in parts if isinstance(p, PreparedVideo)]

    def pixels(ps: list) -> torch.Tensor:
        return reference_pixels(torch.cat([torch.from_numpy(p.rows) for p in ps]), v.mean, v.std)

    if images:
        args.update(pixel_values=pixels(images),
                    image_grid_thw=torch.tensor([p.grid.dims for p in images]))
    if videos:
        args.update(pixel_values_videos=pixels(videos),
                    video_grid_thw=torch.tensor([p.grid.dims for p in videos]))
        if s.ours.spec.model_type == "qwen2_5_vl":  # the processor's: [T / fps per video]
            args["second_per_grid_ts"] = torch.tensor([2 / (fps or p.fps) for p in videos])
    with torch.no_grad():
        return s.ref(**args).logits[0, -1]


def test_rows_follow_the_video_processors_layout() -> None:
    """Our rows equal ``Qwen2VLVideoProcessor._preprocess``'s view/permute of the frames
    (``[B, F, C, H, W]``), restated."""
    frames = random_frames(4, 56, 84, 1)
    v = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]  # [1, F, C, H, W]
    x = v.view(1, 2, 2, 3, 2, 2, 14, 3, 2, 14).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    want = x.reshape(1, 2 * 4 * 6, 3 * 2 * 14 * 14)[0]
    assert torch.equal(torch.from_numpy(video_rows(frames, 14, 2, 2)), want)


def test_one_image_as_parts_is_build(setup: Setup) -> None:
    im = an_image(setup, 200, 90, 3)
    for system in (None, "Answer yes or no."):
        one = setup.prompts.build(QUESTION, im, system)
        many = setup.prompts.build_parts(QUESTION, [im], system)
        assert one.ids == many.ids and one.prefix_len == many.prefix_len
        assert one.rope_delta == many.rope_delta
        assert torch.equal(one.positions, many.positions)


@pytest.mark.parametrize("layout", ["video", "images", "image-video-image"])
def test_logits_match_transformers(setup: Setup, layout: str) -> None:
    parts: list[MediaPart] = {
        "video": [a_clip(setup)],
        "images": [an_image(setup, 200, 90, 1), an_image(setup, 60, 170, 2)],
        "image-video-image": [an_image(setup, 90, 90, 3), a_clip(setup, 4, 3, 2, seed=4),
                              an_image(setup, 120, 60, 5)]}[layout]
    prompt = setup.prompts.build_parts(QUESTION, parts)
    got, want = our_logits(setup, prompt, parts), reference_logits(setup, prompt, parts)
    assert (got - want).abs().max() <= TOL


def test_qwen2_5_vl_time_positions(setups: dict[str, Setup]) -> None:
    """Temporal positions step by tokens_per_second (3) * 2 / fps (0.5) = 12 per patch."""
    s = setups["qwen2_5_vl"]
    prompt = s.prompts.build_parts(QUESTION, [a_clip(s)])
    assert prompt.positions is not None
    start = prompt.parts[0][0][0]
    t = prompt.positions[0, start: start + prompt.parts[0][0][1]].unique()
    assert (t - start).tolist() == [0, 12, 24]


@pytest.mark.parametrize("kind", KINDS)
def test_fault_frames_out_of_order_is_caught(setups: dict[str, Setup], kind: str) -> None:
    """Our side given the clip's temporal patches swapped (rows of patch 0 and 1) misses the
    reference by > 100x the tolerance. Measured max |logit difference| (max |logit| 2.1-3.0):
    Qwen2-VL 0.105, Qwen2.5-VL 0.378, Qwen3-VL 0.347, Qwen3.5 0.431; the clip as sampled
    1.3e-6 (Qwen3.5 4.6e-6)."""
    s = setups[kind]
    good = a_clip(s)
    n = good.rows.shape[0] // good.grid.dims[0]
    rows = np.concatenate([good.rows[n: 2 * n], good.rows[:n], good.rows[2 * n:]])
    bad = dataclasses.replace(good, rows=rows)
    prompt = s.prompts.build_parts(QUESTION, [good])
    assert (our_logits(s, prompt, [bad])
            - reference_logits(s, prompt, [good])).abs().max() > 100 * TOL


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_fault_wrong_time_is_caught(setups: dict[str, Setup], kind: str) -> None:
    """Qwen2.5-VL: our prompt made as if sampled at 2 fps (second_per_grid_t 1, the old
    silent default) against the reference at the clip's 0.5 fps; Qwen3-VL: the frame times
    shifted by 4 s (other ``<t seconds>`` texts). Measured max |logit difference|: 0.231,
    0.841 (Qwen3.5 0.537)."""
    s = setups[kind]
    good = a_clip(s)
    bad = (dataclasses.replace(good, fps=2.0) if kind == "qwen2_5_vl" else
           dataclasses.replace(good, seconds=tuple(x + 4 for x in good.seconds)))
    want = reference_logits(s, s.prompts.build_parts(QUESTION, [good]), [good])
    got = our_logits(s, s.prompts.build_parts(QUESTION, [bad]), [bad])
    assert (got - want).abs().max() > 100 * TOL


def test_qwen3_vl_prompt_is_the_processors(setups: dict[str, Setup]) -> None:
    """Qwen3-VL's ids equal the tokenizer's ids of the text transformers 5.25 writes: the
    chat template's video part (``<|vision_start|><|video_pad|><|vision_end|>``) collapsed and
    replaced by ``Qwen3VLProcessor.replace_video_token``'s own output (called on a processor
    holding only what that method reads), tokenized at once."""
    from types import SimpleNamespace

    from transformers import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    s = setups["qwen3_vl"]
    video = a_clip(s, frames=5 + 1, seed=7)
    video = dataclasses.replace(video, seconds=video.seconds[:5])  # odd: last time repeated
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    proc.video_token = "<|video_pad|>"
    proc.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    meta = VideoMetadata(total_num_frames=64, fps=4.0, frames_indices=list(video.frame_indices[:5]))
    expansion = proc.replace_video_token(
        {"video_grid_thw": torch.tensor([video.grid.dims]), "video_metadata": [meta]}, 0)
    tok = s.prompts.tok
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    wrapper = "<|vision_start|><|image_pad|><|vision_end|>"  # our template's; Qwen3-VL's video
    assert text.count(wrapper) == 1
    want = tok.encode(text.replace(wrapper, expansion), add_special_tokens=False)
    assert "<1.0 seconds>" in expansion and "<8.0 seconds>" in expansion  # (8 + 8) / 2
    assert list(s.prompts.build_parts(QUESTION, [video]).ids) == want


def test_the_decoding_sides_rows_are_these(setups: dict[str, Setup]) -> None:
    """``preprocessing/video_rows.qwen_rows`` (what decoded clips become) lays frames out as
    the rows these tests feed both sides (and the processor's reshape, above)."""
    from vlmbatch.preprocessing.video_rows import QwenVideoLayout, qwen_rows

    frames = random_frames(4, 56, 84, 2)
    pre = setups["qwen2_5_vl"].ours.spec.preprocess
    assert np.array_equal(qwen_rows(frames, QwenVideoLayout(pre)), video_rows(frames, 14, 2, 2))
