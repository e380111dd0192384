"""The conversation.py templates and InternLM2's tokenizer, read without remote code.

Templates: each renders a fixed conversation (two user turns, one answer, the last answer
open) exactly as its ``conversation.py`` definition does; the expected strings are written
here from the published file (``internvl_chat/internvl/conversation.py``: the templates'
fields and ``get_prompt``'s MPT and INTERNVL_ZH branches), not produced by our code.

Tokenizer: ``SentencePieceTokenizer`` against the published ``InternLM2Tokenizer``'s rules
written out with the ``sentencepiece`` package directly: ``<s>``, then the text split at
the added tokens, each other piece ``sp_model.encode``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from tests.models.internvl_original_helpers import make_pair
from tests.models.random_original import save_sentencepiece_tokenizer
from vlmbatch.engine.loading import load_model
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.internvl.templates import TEMPLATES
from vlmbatch.models.tokenizer import SentencePieceTokenizer, load_tokenizer

SYS2 = ("你是由上海人工智能实验室联合商汤科技开发的书生多模态大模型，英文名叫InternVL, "
        "是一个有用无害的人工智能助手。")
SYS25 = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作"
         "单位联合开发的多模态大语言模型。")
CHATML = ("<|im_start|>system\n{sys}{sep}<|im_start|>user\nHello!{sep}<|im_start|>assistant\n"
          "Hi!{sep}<|im_start|>user\n<image>\nIs it red?{sep}<|im_start|>assistant\n")
PUBLISHED = {
    "Hermes-2": CHATML.format(sys=SYS2, sep="<|im_end|>"),
    "internlm2-chat": CHATML.format(sys=SYS2, sep="<|im_end|>"),
    "internvl2_5": CHATML.format(sys=SYS25, sep="<|im_end|>\n"),
    "phi3-chat": f"<|system|>\n{SYS2}<|end|><|user|>\nHello!<|end|><|assistant|>\nHi!<|end|>"
                 "<|user|>\n<image>\nIs it red?<|end|><|assistant|>\n",
    "internvl_zh": " <human>: Hello! <bot>: Hi!</s><human>: <image>\nIs it red? <bot>:",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_template_renders_as_published(name: str) -> None:
    t = TEMPLATES[name]
    user, bot = t.roles
    got = t.render([(user, "Hello!"), (bot, "Hi!"), (user, "<image>\nIs it red?"),
                    (bot, None)])
    assert got == PUBLISHED[name]
    assert sorted(TEMPLATES) == sorted(PUBLISHED)


def test_a_config_system_message_replaces_the_templates(tmp_path: Path) -> None:
    """InternVLChatModel reads ``config.system_message`` over the template's."""
    _, original = make_pair(tmp_path, "internvl2_5_qwen2")
    cfg = json.loads((original / "config.json").read_text())
    cfg["system_message"] = "Answer yes or no."
    (original / "config.json").write_text(json.dumps(cfg))
    m = load_model(original)
    text = m.tokenizer.decode(list(m.prompts.build_for_tiles("Is it red?", 1).ids))
    assert text.startswith("<|im_start|>system\nAnswer yes or no.<|im_end|>\n<|im_start|>user\n"
                           "<img>")
    assert text.endswith("</img>\nIs it red?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sp")
    save_sentencepiece_tokenizer(path)
    return path


TEXTS = ["<|im_start|>system\n" + SYS2 + "<|im_end|><|im_start|>user\n<img><IMG_CONTEXT>"
         "<IMG_CONTEXT></img>\nIs there a red shape?<|im_end|><|im_start|>assistant\n",
         "  two  spaces\n\nand tabs\t", "emoji 🙂 and digits 2026", "Yes"]


def published_encode(path: Path, text: str) -> list[int]:
    """InternLM2Tokenizer: BOS, then PreTrainedTokenizer's split at added tokens, each other
    piece through ``sp_model.encode``."""
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    added = {t["content"]: int(i) for i, t in json.loads(
        (path / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    ids = [sp.bos_id()]
    for piece in re.split("(" + "|".join(map(re.escape, added)) + ")", text):
        ids += [added[piece]] if piece in added else sp.encode(piece) if piece else []
    return ids


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_tokenizer_encodes_as_published(sp_dir: Path, text: str) -> None:
    tok = load_tokenizer(sp_dir)
    assert isinstance(tok, SentencePieceTokenizer)
    ids = tok(text)["input_ids"]
    assert ids == published_encode(sp_dir, text)
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    plain = tok.decode(ids, skip_special_tokens=True)
    assert plain == re.sub(r"<\|im_start\|>|<\|im_end\|>|<img>|</img>|<IMG_CONTEXT>", "", text)


def test_no_remote_code_is_imported(sp_dir: Path) -> None:
    """tokenizer_config.json names the remote-code class (auto_map); nothing of it runs."""
    assert "InternLM2Tokenizer" in (sp_dir / "tokenizer_config.json").read_text()
    load_tokenizer(sp_dir)
    assert not [m for m in sys.modules if m.startswith("transformers_modules")
                or ("internlm2" in m.lower() and not m.startswith("tests."))]


def test_a_sentencepiece_class_without_its_model_file_is_refused(sp_dir: Path,
                                                                 tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text((sp_dir / "tokenizer_config.json")
                                                    .read_text())
    with pytest.raises(ModelError, match="tokenizer.model, and there is none"):
        load_tokenizer(tmp_path)
