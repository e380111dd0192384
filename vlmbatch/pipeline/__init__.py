"""The drive: from items to results, through an engine. One loop for every way in.

- ``records.py``: the drive's records (``ImageItem``, ``Answer`` with its ``ErrorKind``,
  ``ItemError``, ``EmbedItem``, ``Embedding``), built from and into the engine's
  (``engine/records.py``: ``Request``, ``Score``, ``EmbedRequest``, ``Vector``);
- ``media_inputs.py``: what an item holds beyond one image (``ImageList``: several in one
  prompt; ``VideoInput``: a clip and its ``SamplingKeys``), with their checks;
  ``parts.py``: items asked part by part (a clip's windows, images each alone), fanned out
  and reduced to one answer per question;
- ``media_fetch.py``: an item's remote media (a list's images, a clip) fetched with the
  run's fetch options in the serial stage 1, and how many a decode deadline counts;
- ``questions.py``: ``Question`` and the one parser of questions as users write them
  (manifests, policies, rows, the Python API), with ``ManifestError``;
- ``config.py``: ``PrepareConfig`` / ``PrepareOptions``, how stage 1 runs (names only, no
  torch: the CLI's ``--help`` imports it);
- ``task.py``: what a group of items goes through (``Task``: ``AnswerTask``, ``EmbedTask``);
  ``drive.py``: the one drive loop (stage 1 prepared ahead in decoder processes, stage 2 on
  the engine, a sink, per group); ``preparers.py``: stage 1's workers (decoder processes or
  threads, remote images fetched many at once ahead of them); ``hooks.py``: fault injection
  passed in by tests.

The package itself imports nothing, so a process that only prepares images (a Ray prepare
worker: ``drive.prepare_task``) loads ``drive.py``'s light imports, not torch, the models and
transformers.
"""
