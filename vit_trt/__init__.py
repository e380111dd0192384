"""Vision encoder (InternViT + projector on SDPA); ONNX/TensorRT runners come with issue 4."""
