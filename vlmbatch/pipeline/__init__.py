"""Engines and the drive loop: from prepared images and questions to ``Answer``s and
``Embedding``s.

- ``records.py``: the records between stages (``ImageItem``, ``Question``, ``Request``,
  ``Score``, ``Answer`` with its ``ErrorKind``, ``EmbedItem``, ``Vector``, ``Embedding``);
- ``config.py``: ``ModelConfig``, ``EngineConfig``, ``EmbedConfig``, ``PrepareOptions`` (the
  engine side of the config tree; names only, no torch: the CLI's ``--help`` imports it);
  ``paths.py``: where the built-in checkpoints live;
- ``task.py``: what a group of items goes through (``Task``: ``AnswerTask``, ``EmbedTask``);
  ``drive.py``: the one drive loop (stage 1 prepared ahead in decoder processes, stage 2 on
  the engine, a sink, per group); ``preparers.py``: stage 1's workers (decoder processes or
  threads, remote images fetched many at once ahead of them); ``hooks.py``: fault injection
  passed in by tests;
- ``engine.py``: the ``Engine`` interface; ``build.py``: the ``ENGINES`` registry (each
  engine's builder as ``"module:attr"``, imported when built) and ``build_engine``;
- ``torch_engine.py`` (ours: ``planner.py`` pure Python, ``model_runner.py`` tensors,
  ``prefix_cache.py``, ``state_snapshots.py`` (a hybrid decoder's linear-layer states in
  the cache), ``scoring.py``, ``choices.py``: a label set's log-likelihoods in one
  continuation after the prompt's KV; embeddings through ``embed.py``'s head and
  ``pooling.py``) and ``lmdeploy_engine.py`` (TurboMind, GPU env only);
- ``loading.py``: checkpoint folder -> ``LoadedModel`` (family + quant runtime conversions);
- ``evaluate.py`` (easy-vqa accuracy: yes/no, or open questions as label sets),
  ``embed_eval.py`` (easy-vqa retrieval), ``quantize.py`` (the AWQ/GPTQ command's driver).

The package itself imports nothing, so a process that only prepares images (a Ray prepare
worker: ``drive.prepare_task``) loads ``drive.py``'s light imports, not torch, the models and
transformers.
"""
