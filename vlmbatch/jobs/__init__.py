"""Jobs: the run's config root (``config.py``: ``RunConfig``, what ``job.json`` stores;
``ExecutorConfig``), a job's kinds of work (``tasks.py``: ``JobTask``), the job folder and
its SQLite store (``folder.py``, ``store.py``, ``store_schema.py``, ``lock.py``), running a
job (``job.py``: ``submit``, ``drive_job``, ``JobRun``), answers copied from an earlier
job (``reuse.py``) and the Ray executor
(``ray_executor.py``, ``ray_cluster.py``). Inputs are read by ``inputs/``, results written
by ``outputs/``; a plain ``run`` with no job is ``cli/run.py``. Computes no tensors:
answers come from the drive (``pipeline/``) over an engine. What ``status`` and ``cancel``
read (``folder.py``, the store, ``config.py``) imports no torch and no image decoder.
"""
