"""CUDA graph pool keyed by batch-size bucket (issue 4). Not built yet: nothing here runs."""
