"""A checkpoint folder's JSON files and the error for a folder that is missing, incomplete or
of an unsupported kind (``ModelError``). No torch and no weights, so that naming the families
(``models/registry.py``: ``family_for``), reading the embedding declarations and the CLI's
error handling stay light; ``io.py`` reads the weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# ORG/NAME as the Hugging Face hub names a repository (what `--model` is often given)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelError(RuntimeError):
    """The model directory is missing, incomplete or of an unsupported kind."""


def unreadable_weights(file: Path, e: Exception) -> ModelError:
    """The one error for a weights file safetensors cannot read (its header, or a tensor past
    the end of a cut file), whichever family or command reads it."""
    return ModelError(f"{file} cannot be read ({e}): the file is truncated or corrupt; copy "
                      "or download it again")


def read_json(p: Path) -> dict:
    """``p`` as a dict, ``{}`` if absent; ModelError naming the file if it is not a JSON object."""
    if not p.is_file():
        return {}
    try:
        d = json.loads(p.read_text())
    except ValueError as e:  # JSONDecodeError; UnicodeDecodeError for a binary file
        raise ModelError(f"{p} is not valid JSON ({e}); restore it from the original "
                         "checkpoint") from e
    if not isinstance(d, dict):
        raise ModelError(f"{p} is not a JSON object; restore it from the original checkpoint")
    return d


def read_config(path: Path) -> dict:
    """The model directory's ``config.json``; ModelError, saying what to do, if absent."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file() and not path.exists() and _HUB_ID.fullmatch(str(path)):
        raise ModelError(
            f"no model folder {path}: vlmbatch reads checkpoints from local folders and "
            f"downloads nothing. {path} looks like a Hugging Face hub id: download it first, "
            f"e.g. `huggingface-cli download {path} --local-dir ./{path.name}`, then pass "
            f"--model ./{path.name}")
    if not cfg_file.is_file():
        raise ModelError(
            f"no model at {path}: looked for {cfg_file}. Pass --model DIR with an HF-format "
            "checkpoint (config.json, *.safetensors, tokenizer files), or leave --model out to "
            "use the built-in model.")
    return read_json(cfg_file)
