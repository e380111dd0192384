"""Jobs: manifests and policies (``manifest.py``), the OpenAI batch format
(``openai_batch.py``), the run's config tree (``config.py``), sinks and exports
(``sinks.py``, ``export.py``), the in-process runner (``runner.py``), the job folder and its
SQLite store (``folder.py``, ``store.py``, ``lock.py``, ``job.py``) and the Ray executor
(``ray_executor.py``, ``ray_cluster.py``). Computes no tensors: answers come from
``pipeline/``."""
