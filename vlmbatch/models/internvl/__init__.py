"""InternVL in both checkpoint layouts (``docs/internvl.md``): InternViT vision encoder +
pixel shuffle (v1, v2) + MLP projector (``vision.py``), prompts from a chat template or one of the
original releases' conversation templates (``prompt.py``; those as data in ``templates.py``), the
text models' decoder specs (``text.py``: Qwen2, Qwen3, Llama, InternLM2), the HF-native
family's spec, loader and image plan (``family.py``, registered as ``internvl``), the
original ``InternVLChatModel`` layout (``original.py``, registered as ``internvl_chat``),
the built-in model's tokenizer (``tokenizer.py``) and random-weight checkpoints for tests
and benchmarks (``random.py``; the original layout written from one of them is the tests'
``tests/models/random_original.py``)."""
