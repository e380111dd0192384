"""Engines and the drive loop: from prepared images and questions to ``Answer``s.

- ``records.py``: the records between stages (``ImageItem``, ``Question``, ``Request``,
  ``Score``, ``Answer`` with its ``ErrorKind``);
- ``config.py``: ``ModelConfig`` and ``EngineConfig`` (the engine side of the config tree;
  names only, no torch: the CLI's ``--help`` imports it), ``paths.py`` the built-in models;
- ``engine.py``: the ``Engine`` interface; ``build.py``: the ``ENGINES`` registry (each
  engine's builder as ``"module:attr"``, imported when built) and ``build_engine``;
- ``torch_engine.py`` (ours: ``planner.py`` pure Python, ``model_runner.py`` tensors,
  ``prefix_cache.py``, ``scoring.py``) and ``lmdeploy_engine.py`` (TurboMind, GPU env only);
- ``loading.py``: checkpoint folder -> ``LoadedModel`` (family + quant runtime conversions);
- ``drive.py``: items -> prepared groups (preprocessing threads) -> ``Answer``s;
- ``evaluate.py`` (easy-vqa accuracy), ``quantize.py`` (the AWQ/GPTQ command's driver).

The package itself imports nothing, so a process that only prepares images (a Ray prepare
worker: ``drive.prepare_task``) loads ``drive.py``'s light imports, not torch, the models and
transformers.
"""
