"""Loading a checkpoint's tokenizer, and byte-level BPE tokenizers of our own for the built-in
models and random test checkpoints.

Loading (``load_tokenizer``): transformers' ``AutoTokenizer``, except for tokenizers that
exist only as remote code over a SentencePiece ``tokenizer.model`` (InternLM2's, in
InternVL's original releases), which ``SentencePieceTokenizer`` reads with the
``sentencepiece`` package: no checkpoint code is run.

Our own: byte-level, so any text (any language) tokenizes; the vocabulary is learnt from a small
corpus (training questions), so common words such as "yes"/"no" are single tokens. Each
family gives its special tokens and chat template (``models/internvl/tokenizer.py``,
``models/qwen_vl/tokenizer.py``) so that the same prompt code serves a real checkpoint.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from vlmbatch.models.config_io import ModelError, read_json

# tokenizer_config.json classes that are remote code over a SentencePiece tokenizer.model,
# read here by SentencePieceTokenizer instead
SENTENCEPIECE_CLASSES = ("InternLM2Tokenizer", "InternLM2TokenizerFast")


def chat_template(image_part: str) -> str:
    """A chat template rendering each message as ``<|im_start|>ROLE\\n`` + its parts (an
    image part as ``image_part``, a text part as its text) + ``<|im_end|>\\n``, then
    ``<|im_start|>assistant\\n`` for a generation prompt. No default system prompt."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_part + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def load_tokenizer(path: Path) -> Any:
    """A checkpoint's tokenizer (transformers' ``AutoTokenizer``, or ``SentencePieceTokenizer``
    where tokenizer_config.json names a remote-code class of ``SENTENCEPIECE_CLASSES``: no
    remote code runs); ModelError if it cannot be read. A family then checks it with
    ``check_tokenizer``."""
    cls = read_json(path / "tokenizer_config.json").get("tokenizer_class")
    try:
        if cls in SENTENCEPIECE_CLASSES:
            if not (path / "tokenizer.model").is_file():
                raise ModelError(f"{path}: tokenizer_config.json names {cls}, whose "
                                 "vocabulary is tokenizer.model, and there is none")
            return SentencePieceTokenizer.from_pretrained(str(path), **_special_tokens(path))
        # never the checkpoint's code, and never a prompt asking whether to run it
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
        raise ModelError(f"cannot load the tokenizer from {path}: {e}") from e


def _special_tokens(path: Path) -> dict[str, list[str]]:
    """``additional_special_tokens`` from special_tokens_map.json where tokenizer_config.json
    has none (transformers 5 reads only the latter). They are what ``skip_special_tokens``
    drops, as the published class's ``all_special_ids`` (transformers 4) did."""
    if "additional_special_tokens" in read_json(path / "tokenizer_config.json"):
        return {}
    tokens = read_json(path / "special_tokens_map.json").get("additional_special_tokens", [])
    return {"additional_special_tokens": [t if isinstance(t, str) else t["content"]
                                          for t in tokens]} if tokens else {}


class SentencePieceTokenizer(SentencePieceBackend):
    """InternLM2's tokenizer (``tokenization_internlm2.py``, remote code in the checkpoints)
    without its code: the same rules over the ``sentencepiece`` package.

    Encoding: the text is split at added tokens (``added_tokens_decoder`` of
    tokenizer_config.json: ``<|im_start|>``, ``<img>``, ...), each other piece is
    ``sp_model.encode(piece)`` as the model file says (its own dummy-prefix and
    byte-fallback settings), and ``<s>`` goes first when ``add_bos_token`` (the default;
    ``</s>`` last when ``add_eos_token``). Decoding: runs of vocabulary pieces through
    ``sp_model.decode``, added tokens as their text (dropped with ``skip_special_tokens``).
    The published class also puts a space before a special token that follows text; we
    write none (no prompt is decoded, and answers are decoded without special tokens).
    """

    def __init__(self, vocab_file: str | None = None, unk_token: str = "<unk>",
                 bos_token: str = "<s>", eos_token: str = "</s>", pad_token: str = "</s>",
                 add_bos_token: bool = True, add_eos_token: bool = False,
                 **kwargs: Any) -> None:
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        kwargs.pop("decode_with_prefix_space", None)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(vocab_file=vocab_file, unk_token=unk_token, bos_token=bos_token,
                         eos_token=eos_token, pad_token=pad_token, legacy=True, **kwargs)

    def build_inputs_with_special_tokens(self, token_ids_0: list[int],
                                         token_ids_1: list[int] | None = None) -> list[int]:
        ids = ([self.bos_token_id] if self.add_bos_token else []) + token_ids_0
        ids += token_ids_1 or []
        return ids + ([self.eos_token_id] if self.add_eos_token else [])

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return int(self.add_bos_token) + int(self.add_eos_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out: list[str] = []
        run: list[str] = []
        added = set(self.added_tokens_encoder) | set(self.all_special_tokens)
        for t in tokens:
            if t in added:
                out += [self.sp_model.decode(run), t]
                run = []
            else:
                run.append(t)
        return "".join(out) + self.sp_model.decode(run)


def check_tokenizer(tok: Any, path: Path, has: dict[str, bool], family: str) -> Any:
    """``tok``, or ModelError naming the image tokens of ``has`` (name -> present) it lacks,
    or saying its chat template is missing, with what to copy."""
    missing = [name for name, ok in has.items() if not ok]
    if missing:
        raise ModelError(f"the tokenizer in {path} lacks {family}'s image tokens "
                         f"({', '.join(missing)}); copy the checkpoint's tokenizer files "
                         "(tokenizer.json, tokenizer_config.json) into the folder")
    if getattr(tok, "chat_template", None) is None:
        raise ModelError(f"the tokenizer in {path} has no chat template; copy the "
                         "checkpoint's chat_template.jinja (or tokenizer_config.json) into "
                         "the folder")
    return tok


def bpe_tokenizer(corpus: Iterable[str], vocab_size: int, special: list[str],
                  chat_template: str, extra_special: dict[str, str] | None = None,
                  eos: str = "<|im_end|>", pad: str = "<|endoftext|>"
                  ) -> PreTrainedTokenizerFast:
    """A BPE of ``vocab_size`` trained on ``corpus``; ``special`` get the first ids, in
    order; ``extra_special`` names some of them as tokenizer attributes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad,
        extra_special_tokens=extra_special or {}, chat_template=chat_template,
        model_max_length=4096)
