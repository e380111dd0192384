"""Jobs: manifests and policies (``manifest.py``), the OpenAI batch format
(``openai_batch.py``), the run's config tree (``config.py``), sinks and exports
(``sinks.py``, ``export.py``), the in-process runner (``runner.py``), the job folder and its
SQLite store (``folder.py``, ``store.py``, ``store_schema.py``, ``lock.py``, ``job.py``), a
job's task (``tasks.py``), embedding inputs, sinks and OpenAI embedding-request lines
(``embed_input.py``, ``embed_sinks.py``, ``openai_embeddings.py``; ``embed_requests.py``
prepares and embeds a job of them), ``errors.py``, and the Ray executor
(``ray_executor.py``, ``ray_cluster.py``). Computes no tensors: answers come from
``pipeline/``. What ``status``, ``cancel`` and ``results`` read (``folder.py``, the store,
``export.py``, ``config.py``) imports no torch and no image decoder."""
