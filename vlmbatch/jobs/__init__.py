"""Jobs: manifests and policies (``manifest.py``, their errors: ``errors.py``), the OpenAI
batch format (``openai_batch.py``; ``/v1/embeddings`` request lines and the task of a job of
them: ``openai_embeddings.py``), embedding inputs (``embed_input.py``), Parquet, HF-dataset
and WebDataset inputs listed as references to their rows and members (``datasets.py``), the
run's config tree (``config.py``), sinks and exports (``sinks.py``, ``embed_sinks.py``,
``export.py``), the in-process runner (``runner.py``), a job's kinds of work (``tasks.py``),
the job folder and its SQLite store (``folder.py``, ``store.py``, ``store_schema.py``,
``lock.py``, ``job.py``), answers copied from an earlier job (``reuse.py``) and the Ray
executor (``ray_executor.py``, ``ray_cluster.py``).
Computes no tensors: answers come from the drive (``pipeline/``) over an engine. What
``status``, ``cancel`` and ``results`` read (``folder.py``, the store, ``export.py``,
``config.py``) imports no torch and no image decoder."""
