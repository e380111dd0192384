"""Job inputs (manifests, policies, sources), the in-process runner, results. Computes no tensors."""
