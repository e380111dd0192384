"""Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense): config specs (``spec``), vision
towers (``vision``, index maths in ``vision_grid``), M-RoPE decoders (``text``), prompt
positions (``positions``), checkpoint loading (``load``); shared small layers in ``layers``.
Preprocessing lives in ``preprocessing/qwen_vl.py``; tests in ``tests/models``."""
