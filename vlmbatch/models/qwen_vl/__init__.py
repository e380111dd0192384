"""Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense): config specs (``spec``), vision
towers (``vision``, index maths in ``vision_grid``, the budget form in ``vision_static``,
attention inside images in ``segments``), the family (``family``), prompts (``prompt``;
several images and clips, ``parts``) and their M-RoPE positions (``positions``), checkpoint
loading (``load``), our tokenizer and random checkpoints (``tokenizer``, ``random``). The
decoder is ``models/decoder.py``'s with an M-RoPE spec; RMSNorm, rotary tables and
activations are ``models/layers.py``'s, shared with InternVL. Preprocessing lives in
``preprocessing/qwen_vl.py``; tests in ``tests/models``."""
