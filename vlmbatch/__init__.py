"""vlmbatch: ask a vision-language model yes/no questions about very many images, and turn
images and texts into embeddings.

One import root: every package lives under ``vlmbatch/`` (the layers of docs/structure.md,
top to bottom: ``cli`` (the command line and its drivers), ``api`` (the Python API and its
Ray Data stages) and ``server`` (the server's HTTP side), ``labels`` (labelled evaluation,
calibration, the report) and ``serving`` (the server's engine side), ``outputs`` (writing
results), ``jobs`` (the job store and the executors), ``inputs`` (reading inputs),
``pipeline`` (the drive loop), ``engine`` (the model behind one interface), ``vit_trt`` and
``quant``, ``models``, ``preprocessing``/``cudagraph_pool``, ``common``).

``import vlmbatch`` imports nothing heavy: the public names below resolve to their modules
on first use (module ``__getattr__``), so a process that only prepares images, or the CLI's
``--help``, never pays for torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> "module:attribute", imported on first use
_LAZY = {
    "VLM": "vlmbatch.api.vlm:VLM",
    "maxsim": "vlmbatch.engine.pooling:maxsim",
    "Answer": "vlmbatch.pipeline.records:Answer",
    "Embedding": "vlmbatch.pipeline.records:Embedding",
    "EmbedItem": "vlmbatch.pipeline.records:EmbedItem",
    "ErrorKind": "vlmbatch.pipeline.records:ErrorKind",
    "ImageItem": "vlmbatch.pipeline.records:ImageItem",
    "Question": "vlmbatch.pipeline.questions:Question",
    "video": "vlmbatch.pipeline.media_inputs:video",
    "each_image": "vlmbatch.pipeline.media_inputs:each_image",
    "MODEL": "vlmbatch.models.paths:DEFAULT_MODEL",
    "EMBED_MODEL": "vlmbatch.models.paths:DEFAULT_EMBED_MODEL",
    "QWEN_MODEL": "vlmbatch.models.paths:DEFAULT_QWEN_MODEL",
}

__all__ = ["EMBED_MODEL", "MODEL", "QWEN_MODEL", "VLM", "Answer", "EmbedItem", "Embedding",
           "ErrorKind", "ImageItem", "Question", "each_image", "maxsim",
           "video"]  # = _LAZY's keys (tested)

if TYPE_CHECKING:
    from vlmbatch.api.vlm import VLM
    from vlmbatch.engine.pooling import maxsim
    from vlmbatch.models.paths import DEFAULT_EMBED_MODEL as EMBED_MODEL
    from vlmbatch.models.paths import DEFAULT_MODEL as MODEL
    from vlmbatch.models.paths import DEFAULT_QWEN_MODEL as QWEN_MODEL
    from vlmbatch.pipeline.media_inputs import each_image, video
    from vlmbatch.pipeline.questions import Question
    from vlmbatch.pipeline.records import Answer, Embedding, EmbedItem, ErrorKind, ImageItem


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'vlmbatch' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
