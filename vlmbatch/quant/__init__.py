"""Offline quantisation (``vlmbatch quantize``, driven by ``cli/quantize.py``) and the
runtime modules its checkpoints load into.

Modules, in data-flow order:

- ``calibrate.py``: layer-by-layer pass over the language model, hooks on its linears,
  multimodal calibration through the serving engine;
- ``gptq.py`` / ``awq.py``: the two algorithms (papers' definitions, tested as such);
- ``int4.py``: symmetric group-wise int4 (quantise, pack in compressed-tensors' layout) and
  ``Int4Linear``, the W4A16 layer on CPU or CUDA;
- ``runtime.py``: the swap of a loaded float decoder's linears for ``Int4Linear`` or torch's
  dynamic int8 ones (``engine/loading.py`` calls it; no loader imports this package);
- ``checkpoint.py``: writing and reading compressed-tensors ``pack-quantized`` checkpoints;
- ``fp8.py``: e4m3 W8A8 linears (``--quant fp8``) through ``torch._scaled_mm`` on CUDA and a
  CPU reference of the same arithmetic.

The int8 paths need no checkpoint: ``--llm-quant int8-dynamic`` (torch dynamic int8 linears,
CPU) and ``--vit-backend onnxruntime-int8`` (``vit_trt/export.quantize_int8``).
See docs/quantization.md for the figures.

The package itself holds only the names ``vlmbatch quantize`` offers and its defaults, so the
CLI's parser reads them without importing torch.
"""

METHODS = ("awq", "gptq", "rtn")  # rtn: plain round-to-nearest, for comparison
GROUP_SIZE = 128  # input columns per int4 scale
SAMPLES = 128  # calibration (image, question) pairs
