"""The engine: prepared images and questions in, scores and vectors out, behind one narrow
interface. Knows nothing of jobs, manifests or the drive loop.

- ``base.py``: the ``Engine`` interface, its stats; ``records.py``: what crosses it
  (``Request``, ``Score``, ``EmbedRequest``, ``Vector``, ``MediaItem``: an item of several
  images or a clip); ``config.py``: ``ModelConfig``,
  ``EngineConfig``, ``EmbedConfig`` and ``Resolved`` (names only, no torch: the CLI's
  ``--help`` imports it); ``build.py``: the ``ENGINES`` registry (each engine's builder as
  ``"module:attr"``, imported when built) and ``build_engine``;
- ``torch_engine.py``: ours, over ``packing.py`` (pure Python: an image's prefix and its
  questions in one row, steps of rows per token budget), ``planner.py`` (pure Python:
  phases, cache lookups, batches), ``model_runner.py`` (tensors: encode, prefill, decode),
  ``prefix_cache.py``
  (the image-aware KV block pool), ``state_snapshots.py`` (a hybrid decoder's linear-layer
  states in the cache), ``scoring.py`` (P(yes), answer tokens), ``choices.py`` (a label
  set's log-likelihoods in one continuation after the prompt's KV), ``features.py`` (a
  clip's frame-group vision features cached by content), ``embed.py`` (the
  embedding head) and ``pooling.py``;
- ``lmdeploy_engine.py``: TurboMind behind the same interface (GPU env only);
- ``loading.py``: checkpoint folder -> ``LoadedModel`` (family + quant's runtime
  conversions).
"""
