"""Where the built-in checkpoints live (shipped as package data beside this file); a module
of its own so that naming them (``vlmbatch.MODEL``, the CLI's defaults) imports nothing."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

DEFAULT_MODEL = _HERE / "default_model"  # the built-in InternVL-architecture model
# the built-in embedding model: the built-in model after a contrastive stage
# (scripts/train_embed_model.py); what `vlmbatch embed` uses unless --model says otherwise
DEFAULT_EMBED_MODEL = _HERE / "default_embed_model"
# the built-in Qwen2.5-VL model (scripts/train_qwen_model.py): the second family, trained
DEFAULT_QWEN_MODEL = _HERE / "default_qwen_model"
