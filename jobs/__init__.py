"""Job inputs (manifests, policies, sources) and the in-process runner. Computes no tensors."""
