"""Vision encoder (InternViT + projector on SDPA), its ONNX export, and the runners behind
``encode(tiles)``: torch (optionally CUDA-graph pooled), onnxruntime, TensorRT."""
