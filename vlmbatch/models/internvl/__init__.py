"""InternVL (HF-native ``internvl`` checkpoints, Qwen2 decoder): InternViT vision encoder +
pixel shuffle + MLP projector (``vision.py``), chat-template prompts (``prompt.py``), the
family's spec, loader and image plan (``family.py``, registered as ``internvl``), the
built-in model's tokenizer (``tokenizer.py``) and random-weight checkpoints for tests and
benchmarks (``random.py``)."""
