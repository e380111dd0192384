"""The Python API: ``VLM`` (``vlm.py``: ``ask``, ``ask_batch``, ``embed``, ``label``; the
same drive loop as ``vlmbatch run``, so its answers are the run's lines), and the Ray Data
stages over it (``ray_data.py``: ``Answerer``, ``Preparer``, ``Embedder`` for
``Dataset.map_batches``; ``docs/python.md``), whose rows may hold an ``image``, an
``images`` list or a ``video`` (``ray_columns.py``: the columns read and the clip columns
written). ``vlmbatch.VLM`` resolves here on first use;
the package itself imports nothing.
"""
