"""InternVL (HF-native) prompts with a clip or several images against transformers 5.25: the
prompt equals the chat template's text with the processor's own ``replace_video_token`` /
``replace_image_token`` output in place of each part (called on a processor holding only
what they read), tokenized at once; and our tower's tiles written into every
``<IMG_CONTEXT>`` run, through our ``prefill``, give ``InternVLForConditionalGeneration``'s
logits on the same ids and tiles (normalised the model card's way) within 1e-4 (fp32, CPU;
every weight of the fixture random, ``tests/conftest.py``). A clip's frames swapped on our
side miss by far more.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import InternVLForConditionalGeneration, InternVLProcessor

from tests.conftest import reference_pixels
from vlmbatch.engine.loading import load_model
from vlmbatch.models.base import LoadedModel, Prompt
from vlmbatch.preprocessing.media import MediaPart, PreparedVideo
from vlmbatch.preprocessing.prepare import PreparedImage, prepare
from vlmbatch.preprocessing.tiling import TileGrid

TOL = 1e-4
QUESTION = "Is there a red shape?"


@pytest.fixture(scope="module")
def models(random_model_dir):  # noqa: ANN001, ANN201
    return (load_model(random_model_dir),
            InternVLForConditionalGeneration.from_pretrained(str(random_model_dir)).eval())


def a_clip(ours: LoadedModel, frames: int, seed: int) -> PreparedVideo:
    side = ours.spec.tiling.tile_size  # type: ignore[attr-defined]
    rows = np.random.default_rng(seed).integers(0, 256, (frames, side, side, 3), dtype=np.uint8)
    groups = tuple(f"frame{seed}-{i}" for i in range(frames))
    return PreparedVideo(rows, TileGrid(1, frames, False), groups, f"clip{seed}",
                         tuple(float(i) for i in range(frames)), tuple(range(frames)), 1.0,
                         side, side)


def an_image(ours: LoadedModel, w: int, h: int, seed: int) -> PreparedImage:
    rng = np.random.default_rng(seed)
    return prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
                   ours.spec.tiling)  # type: ignore[attr-defined]


def processor_text(ours: LoadedModel, parts: list[MediaPart]) -> str:
    tok = ours.tokenizer
    proc = InternVLProcessor.__new__(InternVLProcessor)
    proc.start_image_token, proc.end_image_token = "<img>", "</img>"
    proc.image_token = "<IMG_CONTEXT>"
    proc.image_seq_length = ours.spec.tokens_per_tile  # type: ignore[attr-defined]
    content = [{"type": "image"} for _ in parts] + [{"type": "text", "text": QUESTION}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    pieces = text.split("<IMG_CONTEXT>")  # our template's image part; a video part: <video>
    assert len(pieces) == len(parts) + 1
    out = pieces[0]
    for part, after in zip(parts, pieces[1:]):
        if isinstance(part, PreparedVideo):
            out += proc.replace_video_token({"pixel_values_videos": [part.rows]}, 0)
        else:
            assert isinstance(part.grid, TileGrid)
            out += proc.replace_image_token({"num_patches": [part.grid.num_tiles]}, 0)
        out += after
    return out


def our_logits(ours: LoadedModel, prompt: Prompt, tiles: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        emb = ours.vision(torch.from_numpy(tiles)).flatten(0, 1)
        x = ours.llm.embed_tokens(torch.tensor([prompt.ids]))
        mask = torch.zeros(len(prompt.ids), dtype=torch.bool)
        for runs in prompt.parts:
            for start, n in runs:
                mask[start: start + n] = True
        x[0, mask] = emb
        return ours.llm.prefill(x, torch.tensor([len(prompt.ids)]))[0][0]


def reference_logits(ref: torch.nn.Module, prompt: Prompt, tiles: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([prompt.ids]),
                   pixel_values=reference_pixels(torch.from_numpy(tiles))).logits[0, -1]


def layouts(ours: LoadedModel) -> dict[str, list[MediaPart]]:
    return {"video": [a_clip(ours, 3, 0)],
            "images": [an_image(ours, 200, 90, 1), an_image(ours, 56, 56, 2)],
            "image-video": [an_image(ours, 90, 200, 3), a_clip(ours, 2, 4)]}


@pytest.mark.parametrize("layout", ["video", "images", "image-video"])
def test_prompt_is_the_processors(models, layout: str) -> None:  # noqa: ANN001
    ours, _ = models
    parts = layouts(ours)[layout]
    want = ours.tokenizer(processor_text(ours, parts), add_special_tokens=False)["input_ids"]
    assert list(ours.prompts.build_parts(QUESTION, parts).ids) == want


def test_one_image_as_parts_is_build(models) -> None:  # noqa: ANN001
    ours, _ = models
    im = an_image(ours, 200, 90, 5)
    for system in (None, "Answer yes or no."):
        one = ours.prompts.build(QUESTION, im, system)
        many = ours.prompts.build_parts(QUESTION, [im], system)
        assert (one.ids, one.image_start, one.prefix_len) == (many.ids, many.image_start,
                                                              many.prefix_len)


@pytest.mark.parametrize("layout", ["video", "images", "image-video"])
def test_logits_match_transformers(models, layout: str) -> None:  # noqa: ANN001
    ours, ref = models
    parts = layouts(ours)[layout]
    prompt = ours.prompts.build_parts(QUESTION, parts)
    tiles = np.concatenate([p.rows for p in parts])
    assert (our_logits(ours, prompt, tiles)
            - reference_logits(ref, prompt, tiles)).abs().max() <= TOL


def test_fault_frames_out_of_order_is_caught(models) -> None:  # noqa: ANN001
    ours, ref = models
    video = a_clip(ours, 3, 0)
    prompt = ours.prompts.build_parts(QUESTION, [video])
    swapped = video.rows[[1, 0, 2]]
    assert (our_logits(ours, prompt, swapped)
            - reference_logits(ref, prompt, video.rows)).abs().max() > 100 * TOL


def test_several_images_numbered_in_the_original_layout() -> None:
    """An original checkpoint's conversation template: ``Image-k: `` before each image of
    several (InternVL's model card), none before one image alone."""
    from vlmbatch.models.internvl.parts import parts_text

    ims = [dataclasses.replace(PreparedImage(np.zeros((1, 4, 4, 3), np.uint8),
                                             TileGrid(1, 1, False), "h", 4, 4))
           for _ in range(2)]
    two, _ = parts_text(ims, "\n", True, 2, ("<img>", "<C>", "</img>"))
    one, _ = parts_text(ims[:1], "\n", True, 2, ("<img>", "<C>", "</img>"))
    assert two == "Image-1: <img><C><C></img>\nImage-2: <img><C><C></img>\n"
    assert one == "<img><C><C></img>\n"


def margin_of(logits: torch.Tensor, engine) -> float:  # noqa: ANN001
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    return float(logits[yes].logsumexp(-1) - logits[no].logsumexp(-1))


def test_engine_matches_transformers(models) -> None:  # noqa: ANN001
    """HF-native: ``TorchEngine.score`` on ``MediaItem``s (a clip; two images; an image and a
    clip), two questions each, against transformers' margins (1e-4)."""
    from vlmbatch.engine.config import EngineConfig
    from vlmbatch.engine.records import MediaItem, Request
    from vlmbatch.engine.torch_engine import TorchEngine

    ours, ref = models
    items = [MediaItem(tuple(parts)) for parts in layouts(ours).values()]
    engine = TorchEngine(ours, EngineConfig())
    requests = [Request(i, q) for i in range(len(items)) for q in (QUESTION, "Any circle?")]
    for r, s in zip(requests, engine.score(items, requests)):  # type: ignore[arg-type]
        parts = items[r.image].parts
        prompt = ours.prompts.build_parts(r.question, parts)
        tiles = np.concatenate([p.rows for p in parts])
        assert abs(s.margin - margin_of(reference_logits(ref, prompt, tiles), engine)) <= TOL


@pytest.mark.parametrize("name", ["internvl2_5_qwen2", "internvl3_5_qwen3"])
def test_original_layout_matches_the_model_cards_prompt(tmp_path, name: str) -> None:  # noqa: ANN001
    """An original-layout checkpoint (InternVL2.5 on Qwen2; InternVL3.5 on Qwen3): the ids are
    the model card's (``Frame{i}: <image>\\n`` per frame, ``Image-{k}: <image>\\n`` per image,
    then the question, in the conversation template), and the engine's margins equal
    transformers' on the HF-native twin (1e-4)."""
    from tests.models.internvl_original_helpers import KINDS, make_pair
    from tests.models.test_internvl_original import PUBLISHED
    from vlmbatch.engine.config import EngineConfig
    from vlmbatch.engine.records import MediaItem, Request
    from vlmbatch.engine.torch_engine import TorchEngine

    hf, original = make_pair(tmp_path, name)
    ours = load_model(original)
    ref = InternVLForConditionalGeneration.from_pretrained(str(hf)).eval()
    n = ours.spec.tokens_per_tile  # type: ignore[attr-defined]
    clip_, ims = a_clip(ours, 3, 0), [an_image(ours, 56, 56, 1), an_image(ours, 56, 56, 2)]

    def tag(k: int) -> str:
        return "<img>" + "<IMG_CONTEXT>" * n * k + "</img>"

    written = {"clip": "\n".join(f"Frame{i + 1}: {tag(1)}" for i in range(3)),
               "images": f"Image-1: {tag(1)}\nImage-2: {tag(1)}"}
    items = {"clip": MediaItem((clip_,)), "images": MediaItem(tuple(ims))}
    engine = TorchEngine(ours, EngineConfig())
    keys = sorted(items)
    scores = engine.score([items[k] for k in keys],  # type: ignore[misc]
                          [Request(i, QUESTION) for i in range(len(keys))])
    for key, s in zip(keys, scores):
        text = PUBLISHED[KINDS[name].template].format(image=written[key], q=QUESTION)
        ids = ours.tokenizer(text)["input_ids"]
        prompt = ours.prompts.build_parts(QUESTION, items[key].parts)
        assert list(prompt.ids) == ids
        tiles = np.concatenate([p.rows for p in items[key].parts])
        assert abs(s.margin - margin_of(reference_logits(ref, prompt, tiles), engine)) <= TOL
