"""Engines and the drive loop: from prepared images and questions to ``Answer``s.

- ``records.py``: the records between stages (``ImageItem``, ``Question``, ``Request``,
  ``Score``, ``Answer`` with its ``ErrorKind``);
- ``config.py``: ``ModelConfig`` and ``EngineConfig`` (the engine side of the config tree);
- ``engine.py``: the ``Engine`` interface and the ``ENGINES`` registry; ``build.py`` picks one;
- ``torch_engine.py`` (ours: ``planner.py`` pure Python, ``model_runner.py`` tensors,
  ``prefix_cache.py``, ``scoring.py``) and ``lmdeploy_engine.py`` (TurboMind, GPU env only);
- ``loading.py``: checkpoint folder -> ``LoadedModel`` (family + quant runtime conversions);
- ``drive.py``: items -> prepared groups (preprocessing threads) -> ``Answer``s;
- ``evaluate.py`` (easy-vqa accuracy), ``quantize.py`` (the AWQ/GPTQ command's driver).

Importing the package registers its engines.
"""

from pipeline import lmdeploy_engine as _lmdeploy  # noqa: F401  (registers "lmdeploy")
from pipeline import torch_engine as _torch  # noqa: F401  (registers "torch")
