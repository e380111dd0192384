"""Jobs: manifests and policies (``manifest.py``, their errors: ``errors.py``), the OpenAI
batch format (``openai_batch.py``; embedding requests: ``embed_requests.py``), embedding
inputs (``embed_input.py``), the run's config tree (``config.py``), sinks and exports
(``sinks.py``, ``embed_sinks.py``, ``export.py``), the in-process runner (``runner.py``), a
job's kinds of work (``tasks.py``), the job folder and its SQLite store (``folder.py``,
``store.py``, ``store_schema.py``, ``lock.py``, ``job.py``) and the Ray executor
(``ray_executor.py``, ``ray_cluster.py``). Computes no tensors: answers come from
``pipeline/``."""
