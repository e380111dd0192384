"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression
and Acceleration"): per-input-channel scales chosen from activation statistics.

Linears that read the same input ``x [n, K]`` (q/k/v after the input norm; gate/up after the
post-attention norm; down alone, o alone) share one scale vector ``s [K]``. Multiplying the
weight columns by ``s`` and the input by ``1/s`` leaves the product unchanged in full
precision, but makes the rounding error of salient channels (large ``|x|``) relatively
smaller. The paper searches ``s = mean|x|^alpha`` over a grid of ``alpha`` in [0, 1] for the
smallest output error ``||Q(W diag(s)) (x / s) - W x||^2`` and folds ``1/s`` into the
operation that produces ``x`` (an RMSNorm weight, or the rows of the linear before), so the
runtime does nothing new. ``alpha = 0`` is round-to-nearest, so AWQ is never worse than RTN on
the calibration rows. Scales are normalised by ``sqrt(max * min)`` as AutoAWQ does. The
paper's extra weight-clipping search is not done.
"""

from __future__ import annotations

import torch

from vlmbatch.quant.int4 import dequantize, rtn


def awq_scale(weights: list[torch.Tensor], x: torch.Tensor, group_size: int,
              grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """Best scales for linears ``weights`` (each ``[N_i, K]``) reading ``x [n, K]``.

    Returns (s [K] float32, its output MSE, the MSE of plain round-to-nearest).
    """
    w = torch.cat([t.detach().float() for t in weights])  # [sum N_i, K]
    x = x.reshape(-1, x.shape[-1]).float().to(w.device)  # recorded on the CPU
    ref = x @ w.t()
    x_mean = x.abs().mean(0).clamp(min=1e-8)  # [K]
    best, best_err, rtn_err = torch.ones_like(x_mean), float("inf"), float("inf")
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q, scale = rtn(w * s, group_size)
        out = (x / s) @ dequantize(q, scale, group_size).t()
        err = (out - ref).pow(2).mean().item()
        if i == 0:
            rtn_err = err
        if err < best_err:
            best, best_err = s, err
    return best, best_err, rtn_err
