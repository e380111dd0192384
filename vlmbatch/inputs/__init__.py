"""Reading a run's inputs, each line or row checked as read and a bad one named
(``ManifestError``, ``errors.py``): manifests, folders and policies (``manifest.py``), the
OpenAI batch input lines (chat: ``openai_batch.py``, their several images or clip:
``chat_media.py``; ``/v1/embeddings`` requests:
``openai_embeddings.py``), embedding inputs (``embed_input.py``), Parquet, HF-dataset and
WebDataset inputs listed as references to their rows and shard members (``datasets.py``).
Into the drive's records (``pipeline/records.py``); light (no torch, no image decoding).
"""
