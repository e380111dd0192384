"""The built-in model's tokenizer: byte-level BPE with InternVL's special tokens and chat template.

Byte-level BPE, so any text (any language) tokenizes; the vocabulary is learnt from the
training questions, so common words such as "yes"/"no" are single tokens. Special tokens and
the chat template follow the HF-native InternVL checkpoints (``<img>``, ``<IMG_CONTEXT>``,
``</img>``, ``<|im_start|>``/``<|im_end|>``), so the same prompt code serves a real checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
           "<video>"]

# The InternVL-hf template, less its long default system prompt: an image part becomes
# "<IMG_CONTEXT>\n", which the prompt builder expands to <img> + N x <IMG_CONTEXT> + </img>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 640) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    return fast
