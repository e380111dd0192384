"""Writing results: the result lines, ours and the OpenAI batch output lines (``lines.py``),
the files a run writes group by group (``sinks.py``: JSONL, CSV, OpenAI lines;
``embed_sinks.py``: embeddings as JSONL, Parquet, .npy), and a job's results exported from
its store (``export.py``: ``vlmbatch results``, the server's batch output files). Light:
``results`` imports no torch.
"""
