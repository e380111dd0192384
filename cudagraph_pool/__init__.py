"""CUDA graph pool keyed by batch-size bucket; direct calls (same logic) without CUDA."""

from cudagraph_pool.hazards import capture_hazards
from cudagraph_pool.pool import GraphPool, default_buckets

__all__ = ["GraphPool", "capture_hazards", "default_buckets"]
