"""CUDA graph pools: keyed by batch-size bucket (``pool.py``: ``GraphPool``, fixed-shape
items) or by token budget (``budget.py``: ``BudgetPool``, packed images of any size); direct
calls (same logic) without CUDA. ``hazards.py`` finds what a captured callable must not do
(host syncs, allocations), checked on the CPU."""

from vlmbatch.cudagraph_pool.budget import BudgetPool, default_budgets, pack
from vlmbatch.cudagraph_pool.hazards import capture_hazards
from vlmbatch.cudagraph_pool.pool import GraphPool, default_buckets

__all__ = ["BudgetPool", "GraphPool", "capture_hazards", "default_budgets", "default_buckets",
           "pack"]
