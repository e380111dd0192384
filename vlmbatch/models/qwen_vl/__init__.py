"""Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense): config specs (``spec``), vision
towers (``vision``, index maths in ``vision_grid``, attention inside images in
``segments``), M-RoPE decoders (``text``), prompt positions (``positions``), checkpoint
loading (``load``). RMSNorm, rotary tables and activations are ``models/layers.py``'s,
shared with InternVL. Preprocessing lives in ``preprocessing/qwen_vl.py``; tests in
``tests/models``."""
