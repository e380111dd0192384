"""End to end against transformers: same image and prompt -> same logits (fp32, <= 1e-4).

The reference side is ``InternVLForConditionalGeneration.forward(input_ids, pixel_values)`` with
pixel values normalised the model-card way and the prompt expanded the way transformers'
``InternVLProcessor`` does (``<img>`` + N x ``<IMG_CONTEXT>`` + ``</img>``, then tokenized).

Each test runs on four checkpoints, one per text model of the family (``models`` below):
Qwen2 (InternVL2.5/3), Qwen3 with and without q/k/v/o biases (InternVL3.5), and Llama with
dynamic-NTK rotary scaling past 32 positions (the ``-hf`` conversions of InternLM2 ones).

The fixture's every parameter is random (``tests/conftest.py``), and the last tests show that
this comparison catches a decoder bug: each fault of ``fault_injection.py`` misses the
reference by far more than the tolerance, and so does resetting any one constant-initialised
decoder parameter to transformers' constant.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from transformers import InternVLForConditionalGeneration

from tests.conftest import TEXT_MODELS, make_model_dir, reference_pixels
from tests.models.fault_injection import FAULTS, constant_init_parameters, with_fault
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.base import LoadedModel, Prompt
from vlmbatch.preprocessing.prepare import PreparedImage, prepare

SIZES = [(56, 56), (112, 56), (200, 90), (30, 170), (300, 200)]  # (width, height)
QUESTIONS = ["is there a red shape?", "Does the image contain a circle?"]
TOL = 1e-4  # max |logit difference|


@pytest.fixture(scope="module", params=["qwen2", *TEXT_MODELS])
def models(request, random_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    """Ours and transformers' on one random checkpoint per text model: Qwen2 (the shared
    fixture), Qwen3 with and without biases (InternVL3.5), Llama with dynamic NTK rotary."""
    path = random_model_dir if request.param == "qwen2" else make_model_dir(
        tmp_path_factory.mktemp(request.param), text=TEXT_MODELS[request.param])
    ours = load_model(path)
    ref = InternVLForConditionalGeneration.from_pretrained(str(path)).eval()
    return ours, ref


def dynamic(ours: LoadedModel) -> bool:
    return ours.spec.text.rope_scaling == "dynamic"


def fresh(ref: nn.Module) -> nn.Module:
    """``ref`` with its dynamic rotary back at its initial table: transformers keeps the
    largest one it has built across calls (so an answer would depend on the calls before
    it); ours gives each prompt the table of a fresh model (``models/decoder.py``)."""
    rot = ref.model.language_model.rotary_emb
    if "dynamic" in rot.rope_type:
        rot.inv_freq = rot.original_inv_freq.clone()
        rot.max_seq_len_cached = rot.original_max_seq_len
    return ref


def reference_ids(tok, question: str, n_tokens: int) -> list[int]:  # noqa: ANN001
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    expanded = text.replace("<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * n_tokens + "</img>")
    return tok(expanded, add_special_tokens=False)["input_ids"]


def test_prompt_matches_processor_expansion(models) -> None:  # noqa: ANN001
    ours, _ = models
    for n_tiles in (1, 3, 7):
        p = ours.prompts.build_for_tiles(QUESTIONS[1], n_tiles)
        assert list(p.ids) == reference_ids(ours.tokenizer, QUESTIONS[1],
                                             n_tiles * ours.spec.tokens_per_tile)
        span = p.ids[p.image_start: p.image_start + p.image_len]
        assert set(span) == {ours.spec.image_token_id}


def test_logits_match_transformers(models) -> None:  # noqa: ANN001
    ours, ref = models
    rng = np.random.default_rng(0)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in SIZES]
    assert sorted({im.grid.num_tiles for im in images})[-1] > 1  # several tile counts covered
    requests = [Request(i, q) for i in range(len(images)) for q in QUESTIONS]
    # several batches; a dynamic rotary's cached prefix keeps its own base (see fresh)
    engine = TorchEngine(ours, EngineConfig(max_batch_tokens=300, prefix_cache=not dynamic(ours)))
    scores = engine.score(images, requests)
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    for r, s in zip(requests, scores):
        im = images[r.image]
        n_tokens = im.grid.num_tiles * ours.spec.tokens_per_tile
        ids = reference_ids(ours.tokenizer, r.question, n_tokens)
        with torch.no_grad():
            logits = fresh(ref)(input_ids=torch.tensor([ids]),
                         pixel_values=reference_pixels(torch.from_numpy(im.tiles))).logits[0, -1]
        ly, ln = logits[yes].logsumexp(-1), logits[no].logsumexp(-1)
        assert abs(s.margin - float(ly - ln)) <= 1e-4
        assert abs(s.p_yes - float(torch.sigmoid(ly - ln))) <= 1e-5
        assert s.image_tokens == im.grid.num_tiles * ours.spec.tokens_per_tile


@pytest.fixture(scope="module")
def full_row(models) -> tuple[Prompt, PreparedImage, torch.Tensor]:  # noqa: ANN001
    """One multi-tile image's prompt, the image, and transformers' whole logits row."""
    ours, ref = models
    im = prepare(np.random.default_rng(1).integers(0, 256, (90, 200, 3), dtype=np.uint8),
                 ours.spec.tiling)
    p = ours.prompts.build(QUESTIONS[0], im)
    with torch.no_grad():
        want = fresh(ref)(input_ids=torch.tensor([list(p.ids)]),
                   pixel_values=reference_pixels(torch.from_numpy(im.tiles))).logits[0, -1]
    return p, im, want


def logits_row(vision: nn.Module, llm: nn.Module, p: Prompt,
               image: torch.Tensor) -> torch.Tensor:
    """Our last-position logits [V] for ``p`` with ``image`` (tiles, or the image's
    embeddings [n, D] when they are already 2-D)."""
    with torch.no_grad():
        emb = image if image.dim() == 2 else vision(image).flatten(0, 1)
        x = llm.embed_tokens(torch.tensor([p.ids]))
        x[0, p.image_start: p.image_start + p.image_len] = emb
        return llm.prefill(x, torch.tensor([len(p.ids)]))[0][0]


def test_full_logits_match(models, full_row) -> None:  # noqa: ANN001
    """The whole vocabulary row, not just the yes/no pair, for one multi-tile image (the
    image through the engine's vision runner). Measured: 6e-7."""
    ours, _ = models
    p, im, want = full_row
    emb = TorchEngine(ours, EngineConfig()).encode([im])[0].embeds
    assert (logits_row(ours.vision, ours.llm, p, emb) - want).abs().max() <= TOL


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_decoder_fault_is_caught(models, full_row, fault: str) -> None:  # noqa: ANN001
    """The same comparison on our decoder with a bug injected misses by > 100x the
    tolerance. Measured max |logit difference|: no q/k/v biases 0.85, query heads 0 and 1
    swapped in layer 0 0.26 (the former fixture, transformers' zero biases and 0.02 init:
    9e-8 and 2.9e-4; max |logit| 0.69 there, 2.6 here)."""
    ours, _ = models
    if fault == "no_qkv_biases" and not ours.spec.text.qkv_bias:
        pytest.skip("this text model has no q/k/v biases to drop")
    p, im, want = full_row
    got = logits_row(ours.vision, with_fault(ours.llm, FAULTS[fault]), p,
                     torch.from_numpy(im.tiles))
    assert (got - want).abs().max() > 100 * TOL


def test_dynamic_rotary_is_exercised(models, full_row) -> None:  # noqa: ANN001
    """The Llama fixture's prompt is past max_positions, so its scaled rotary is what the
    match above checks: the same decoder unscaled misses by > 100x the tolerance."""
    ours, _ = models
    if not dynamic(ours):
        pytest.skip("rotary not scaled")
    p, im, want = full_row
    assert len(p.ids) > ours.spec.text.max_positions
    unscaled = copy.deepcopy(ours.llm)
    unscaled.spec = dataclasses.replace(unscaled.spec, rope_scaling="none")
    got = logits_row(ours.vision, unscaled, p, torch.from_numpy(im.tiles))
    assert (got - want).abs().max() > 100 * TOL


def slow_beside(request: pytest.FixtureRequest, ci: tuple[str, ...], reason: str) -> None:
    """Skip this case without ``--run-slow`` unless its text model is one of ``ci``."""
    if (request.node.callspec.params["models"] not in ci
            and not request.config.getoption("--run-slow")):
        pytest.skip(f"slow: run with --run-slow ({reason})")


def test_every_constant_initialised_decoder_parameter_matters(  # noqa: ANN001
        models, full_row, request: pytest.FixtureRequest) -> None:
    """Each decoder parameter that transformers initialises to a constant (biases, norm
    weights) is moved off it far enough that putting it back moves the logits by > 10x the
    tolerance (measured: 0.011 for the least, a k bias; the vision tower's parameters are
    checked on its own output, ``test_internvl_vision.py``)."""
    slow_beside(request, ("qwen2", "qwen3", "qwen3_no_bias"),
                "~10 s; Llama's parameters are Qwen's, and InternLM2's test_internlm2.py")
    ours, _ = models
    p, im, _ = full_row
    llm = copy.deepcopy(ours.llm)
    with torch.no_grad():
        emb = ours.vision(torch.from_numpy(im.tiles)).flatten(0, 1)
    base = logits_row(ours.vision, llm, p, emb)
    small = {}
    for name, t, value in constant_init_parameters(llm, layer_scale=0.5):
        keep = t.detach().clone()
        with torch.no_grad():
            t.fill_(value)
            moved = float((logits_row(ours.vision, llm, p, emb) - base).abs().max())
            t.copy_(keep)
        if moved <= 10 * TOL:
            small[name] = moved
    assert not small, small


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("per_question", [False, True])
def test_greedy_text_matches_transformers_generate(models, cache: bool,  # noqa: ANN001
                                                   per_question: bool,
                                                   request: pytest.FixtureRequest) -> None:
    """Batched greedy decode (over cached prefixes or not) = transformers generate, token for
    token, for prompts of different lengths in one batch. ``per_question``: only every other
    request asks for text (its own max_new_tokens), so decode runs on a subset of the
    batch's rows; the others get none. Without ``--run-slow`` one text model beside Qwen2
    (InternVL3.5's, Qwen3 without biases) runs one case (cache on, every row decoding): the
    others cost ~80 s of CI on 2 cores and share all their decode code with Qwen2's."""
    ours, ref = models
    if cache and dynamic(ours):
        pytest.skip("a cached prefix keeps the rotary base of the prompt that computed it "
                    "(models/decoder.py); past max_positions that differs from a fresh "
                    "prefill of the whole prompt")
    if per_question or not cache:
        slow_beside(request, ("qwen2",), "CI runs Qwen2's four cases and one of Qwen3's")
    slow_beside(request, ("qwen2", "qwen3_no_bias"), "CI runs one Qwen3 case")
    rng = np.random.default_rng(2)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in [(56, 56), (200, 90)]]
    requests = [Request(i, q, (6 if k % 2 else None) if per_question else None)
                for i in range(2) for k, q in enumerate(QUESTIONS)]
    engine = TorchEngine(ours, EngineConfig(prefix_cache=cache,
                                            max_new_tokens=0 if per_question else 6))
    scores = engine.score(images, requests)
    for r, s in zip(requests, scores):
        if per_question and r.max_new_tokens is None:
            assert s.text is None
            continue
        im = images[r.image]
        ids = reference_ids(ours.tokenizer, r.question,
                            im.grid.num_tiles * ours.spec.tokens_per_tile)
        with torch.no_grad():
            out = fresh(ref).generate(input_ids=torch.tensor([ids]),
                               pixel_values=reference_pixels(torch.from_numpy(im.tiles)),
                               max_new_tokens=6, do_sample=False,
                               eos_token_id=sorted(engine.runner.stop_ids),
                               pad_token_id=ours.tokenizer.pad_token_id)
        want = ours.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert s.text == want
    assert sum(len(s.text or "") for s in scores) > 10  # the random model does produce text
