"""InternVL's original layout (``InternVLChatModel``) read without remote code.

Each fixture is an HF-native random checkpoint and the same weights written in the original
layout by the inverse of the key map (``internvl_original_helpers.py``): our loader on the
original must equal our loader on the HF-native twin (1e-6; measured 0: the same floats in
the same modules), and our engine on the original must equal transformers on the twin fed
the prompt the published ``InternVLChatModel.chat`` builds, written out here from its
template (``conversation.py``) and its tokenizer call (``tokenizer(query)``, special tokens
included). Pixel shuffle v1 is checked against the published ``pixel_shuffle`` written here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import InternVLForConditionalGeneration

from tests.conftest import reference_pixels
from tests.models.internvl_original_helpers import KINDS, make_pair, modules
from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model, read_spec
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.internvl.prompt import InternVLPrompts, template_format
from vlmbatch.models.internvl.templates import TEMPLATES
from vlmbatch.preprocessing.prepare import prepare

TOL = 1e-6  # original vs HF-native, ours both
REF_TOL = 1e-4  # ours vs transformers, |logit margin|
SYSTEM_2 = ("你是由上海人工智能实验室联合商汤科技开发的书生多模态大模型，"
            "英文名叫InternVL, 是一个有用无害的人工智能助手。")
SYSTEM_25 = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及"
             "多家合作单位联合开发的多模态大语言模型。")
# conversation.py's templates as InternVLChatModel.chat renders one question: the user
# message '<image>\n' + question, the assistant's open ({image} is the expanded tokens)
PUBLISHED = {
    "internvl2_5": "<|im_start|>system\n" + SYSTEM_25 + "<|im_end|>\n<|im_start|>user\n"
                   "{image}\n{q}<|im_end|>\n<|im_start|>assistant\n",
    "internlm2-chat": "<|im_start|>system\n" + SYSTEM_2 + "<|im_end|><|im_start|>user\n"
                      "{image}\n{q}<|im_end|><|im_start|>assistant\n",
    "Hermes-2": "<|im_start|>system\n" + SYSTEM_2 + "<|im_end|><|im_start|>user\n"
                "{image}\n{q}<|im_end|><|im_start|>assistant\n",
}
QUESTIONS = ["is there a red shape?", "Does the image contain a circle?"]


@pytest.fixture(scope="module", params=sorted(KINDS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Path, Path]:
    hf, original = make_pair(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, hf, original


def test_original_layout_equals_the_hf_native_twin(pair: tuple[str, Path, Path]) -> None:
    name, hf, original = pair
    (v_hf, llm_hf), (v_or, llm_or) = modules(hf), modules(original)
    g = torch.Generator().manual_seed(0)
    tiles = torch.randint(0, 256, (3, 56, 56, 3), dtype=torch.uint8, generator=g)
    x = torch.randn(2, 45, llm_hf.spec.hidden, generator=g)  # past the Llama's 32 positions
    with torch.no_grad():
        assert (v_hf(tiles) - v_or(tiles)).abs().max() <= TOL
        a, kv_a = llm_hf.prefill(x, torch.tensor([45, 30]))
        b, kv_b = llm_or.prefill(x, torch.tensor([45, 30]))
    assert (a - b).abs().max() <= TOL and a.abs().max() > 1.0
    assert all((ka - kb).abs().max() <= TOL for (ka, _), (kb, _) in zip(kv_a, kv_b))
    assert llm_or.spec.qkv_layout == ("grouped" if "internlm2" in name else "separate")


def published_ids(tok, template: str, question: str, n_tokens: int) -> list[int]:  # noqa: ANN001
    image = "<img>" + "<IMG_CONTEXT>" * n_tokens + "</img>"
    return tok(PUBLISHED[template].format(image=image, q=question))["input_ids"]


def test_engine_matches_transformers_on_the_published_prompt(
        pair: tuple[str, Path, Path]) -> None:
    """P(yes) and margin of every (image, question) against transformers on the twin, with
    the prompt as InternVLChatModel.chat builds it (several tile counts)."""
    name, hf, original = pair
    ours = load_model(original)
    ref = InternVLForConditionalGeneration.from_pretrained(str(hf)).eval()
    dynamic = ours.spec.text.rope_scaling == "dynamic"  # see test_internvl_reference.fresh
    rng = np.random.default_rng(0)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in [(56, 56), (200, 90), (30, 170)]]
    requests = [Request(i, q) for i in range(len(images)) for q in QUESTIONS]
    engine = TorchEngine(ours, EngineConfig(prefix_cache=not dynamic))
    scores = engine.score(images, requests)
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)
    for r, s in zip(requests, scores):
        im = images[r.image]
        n = im.grid.num_tiles * ours.spec.tokens_per_tile
        ids = published_ids(ours.tokenizer, KINDS[name].template, r.question, n)
        assert list(ours.prompts.build(r.question, im).ids) == ids
        assert ours.tokenizer.convert_ids_to_tokens(ids[0]) == (
            "<s>" if "internlm2" in name else "<|im_start|>")  # InternLM2's BOS; Qwen's none
        rot = ref.model.language_model.rotary_emb
        if dynamic:  # a fresh table per prompt, as ours (test_internvl_reference.fresh)
            rot.inv_freq, rot.max_seq_len_cached = rot.original_inv_freq, rot.original_max_seq_len
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([ids]),
                         pixel_values=reference_pixels(torch.from_numpy(im.tiles))).logits[0, -1]
        margin = float(logits[yes].logsumexp(-1) - logits[no].logsumexp(-1))
        assert abs(s.margin - margin) <= REF_TOL


def published_pixel_shuffle(x: torch.Tensor, scale: float, ps_version: str) -> torch.Tensor:
    """InternVLChatModel.pixel_shuffle, as published."""
    n, w, h, c = x.size()
    x = x.view(n, w, int(h * scale), int(c / scale))
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * scale), int(w * scale), int(c / (scale * scale)))
    if ps_version != "v1":
        x = x.permute(0, 2, 1, 3).contiguous()
    return x


def test_pixel_shuffle_v1(tmp_path: Path) -> None:
    """ps_version v1 (the original default): transformers' tower and projector around the
    published v1 shuffle; v2 differs (so the check sees the version)."""
    hf, original = make_pair(tmp_path, "internvl2_5_qwen2", ps_version="v1")
    ours = load_model(original)
    ref = InternVLForConditionalGeneration.from_pretrained(str(hf)).eval()
    tiles = torch.randint(0, 256, (2, 56, 56, 3), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = ref.model.vision_tower(reference_pixels(tiles)).last_hidden_state[:, 1:]
        g = int(h.shape[1] ** 0.5)
        x = published_pixel_shuffle(h.reshape(2, g, g, -1), 0.5, "v1")
        want = ref.model.multi_modal_projector(x.reshape(2, -1, x.shape[-1]))
        v2 = ref.model.get_image_features(pixel_values=reference_pixels(tiles)).pooler_output
        got = ours.vision(tiles)
    assert (got - want).abs().max() / want.abs().max() <= 1e-5
    assert (got - v2).abs().max() / v2.abs().max() > 0.01


def test_tiling_fields(tmp_path: Path) -> None:
    hf, original = make_pair(tmp_path, "internvl2_5_qwen2")
    cfg = json.loads((original / "config.json").read_text())
    cfg.update(max_dynamic_patch=4, min_dynamic_patch=2, use_thumbnail=False)
    (original / "config.json").write_text(json.dumps(cfg))
    t = read_spec(original)[1].tiling  # type: ignore[attr-defined]
    assert (t.tile_size, t.min_tiles, t.max_tiles, t.use_thumbnail) == (56, 2, 4, False)
    cfg["dynamic_image_size"] = False
    (original / "config.json").write_text(json.dumps(cfg))
    t = read_spec(original)[1].tiling  # type: ignore[attr-defined]
    assert (t.min_tiles, t.max_tiles) == (1, 1)


@pytest.mark.parametrize(("edit", "message"), [
    ({"template": "vicuna_v1.1"}, r"template 'vicuna_v1.1' is not one we know; known: Hermes-2"),
    ({"llm_config": {"architectures": ["Phi3ForCausalLM"]}},
     r"text model 'Phi3ForCausalLM' is not supported; supported: 'qwen2'"),
    ({"llm_config": {"architectures": ["Qwen3MoeForCausalLM"]}},
     r"mixture-of-experts model \(Qwen3 MoE"),
    ({"llm_config": {"architectures": ["GptOssForCausalLM"]}}, r"GPT-OSS"),
])
def test_what_is_refused(tmp_path: Path, edit: dict, message: str) -> None:
    _, original = make_pair(tmp_path, "internvl2_5_qwen2")
    cfg = json.loads((original / "config.json").read_text())
    cfg.update(edit)
    (original / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=message):
        read_spec(original)


def test_a_tokenizer_without_the_image_token_is_refused(tmp_path: Path) -> None:
    _, original = make_pair(tmp_path, "internvl2_5_qwen2")
    bare = tmp_path / "bare"
    shutil.copytree(original, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ModelError, match="define no <IMG_CONTEXT> token"):
        read_spec(bare)


LABELS = ("yes", "no", "a red circle", "red", "hate speech", "Sí, claro")


@pytest.mark.parametrize("name", ["internvl3_5_qwen3", "internvl2_internlm2"])
def test_a_label_set_scores_as_prompt_and_choice_in_one_sequence(tmp_path: Path,
                                                                  name: str) -> None:
    """A label set on the original layout (a ``conversation.py`` template's prompt):
    ``logprobs`` = transformers on the twin over the published prompt + the choice as one
    sequence, its token log-likelihoods summed (fp32, 1e-4), a choice's tokens being what the
    template's assistant turn holds after the prompt. InternLM2: the grouped ``wqkv``, the
    SentencePiece tokenizer, a system turn replacing the template's system message, and
    dynamic rope configured (its trained length raised past the prompts, so none is scaled:
    the continuation still needs each row's length). Both in ~5 s."""
    text = {"max_position_embeddings": 4096} if "internlm2" in name else {}
    hf, original = make_pair(tmp_path, name, text=text)
    ours = load_model(original)
    ref = InternVLForConditionalGeneration.from_pretrained(str(hf)).eval()
    template = KINDS[name].template
    system = "Answer with one label." if "internlm2" in name else None
    rng = np.random.default_rng(2)
    images = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), ours.spec.tiling)
              for w, h in [(56, 56), (200, 90)]]
    requests = [Request(i, q, choices=LABELS, system=system)
                for i in range(len(images)) for q in QUESTIONS]
    scores = TorchEngine(ours, EngineConfig()).score(images, requests)
    tok, worst = ours.tokenizer, 0.0
    published = PUBLISHED[template]
    if system is not None:
        published = published.replace(SYSTEM_2, system)
    for r, s in zip(requests, scores):
        im = images[r.image]
        n = im.grid.num_tiles * ours.spec.tokens_per_tile
        image = "<img>" + "<IMG_CONTEXT>" * n + "</img>"
        prompt = tok(published.format(image=image, q=r.question))["input_ids"]
        assert list(ours.prompts.build(r.question, im, system).ids) == prompt
        assert s.logprobs is not None and len(s.logprobs) == len(LABELS)
        for c, got in zip(LABELS, s.logprobs):
            ids = list(ours.prompts.answer_ids(c))
            assert ids == tok(c, add_special_tokens=False)["input_ids"]  # MPT: no lead
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([prompt + ids]), pixel_values=
                             reference_pixels(torch.from_numpy(im.tiles))).logits[0]
            lsm = torch.log_softmax(logits.double(), -1)
            want = sum(float(lsm[len(prompt) - 1 + i, t]) for i, t in enumerate(ids))
            worst = max(worst, abs(got - want))
    assert worst <= REF_TOL, worst


def test_a_system_turn_where_the_template_has_no_system_message(tmp_path: Path) -> None:
    """``internvl_zh`` has no system message: a question's system turn is refused, naming
    the template; its answer follows ``<bot>:`` after a space (the lead choices carry)."""
    _, original = make_pair(tmp_path, "internvl2_5_qwen2")
    ours = load_model(original)
    zh = InternVLPrompts(ours.tokenizer, ours.spec.tokens_per_tile, ours.spec.image_token_id,
                         template_format(TEMPLATES["internvl_zh"], None))
    im = prepare(np.zeros((56, 56, 3), dtype=np.uint8), ours.spec.tiling)
    p = zh.build("Which one?", im)
    assert ours.tokenizer.decode(p.ids).endswith("</img>\nWhich one? <bot>:")
    assert zh.answer_ids("yes") == tuple(ours.tokenizer.encode(" yes",
                                                               add_special_tokens=False))
    with pytest.raises(ValueError, match="conversation template 'internvl_zh' renders no "
                                         "system turn"):
        zh.build("Which one?", im, "Be brief.")
