"""Image preprocessing: decode, resize policy, tiling, content hash. Never touches models."""
