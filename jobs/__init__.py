"""Job inputs (manifests, policies, sources, OpenAI batch files), the job store (SQLite), the
in-process runner and the Ray executor. Computes no tensors."""
