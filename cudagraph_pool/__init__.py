"""CUDA graph pool keyed by batch-size bucket; direct calls (same logic) without CUDA."""

from cudagraph_pool.pool import GraphPool, default_buckets

__all__ = ["GraphPool", "default_buckets"]
