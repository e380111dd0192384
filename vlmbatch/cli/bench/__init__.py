"""``vlmbatch bench``: the QPM benchmark as a command, for anyone who installed vlmbatch.

``config.py`` (light: ``--help`` imports it) the command's config root and its sweeps,
``workload.py`` what is answered (``scenes.py``: generated shape scenes, drawn by
``shapes.py``, the project's own training and example data too), ``measure.py`` the timed
rows (``EngineRow``, which ``bench/qpm.py`` builds its vlmbatch rows from), ``baseline.py``
and ``baseline_qwen.py`` the batched and per-question transformers baselines,
``report.py`` the table and JSON, ``command.py`` the command; ``clip_scenes.py`` clips and
image lists of scenes with presence questions (the built-in model's multi-frame training
and ``bench/clip_accuracy.py``). docs/bench.md.
"""
