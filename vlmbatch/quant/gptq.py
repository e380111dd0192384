"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", Algorithm 1), symmetric group-wise int4.

For a linear layer ``W [N, K]`` whose calibration inputs are ``X [n, K]``, GPTQ quantises the
columns of W one at a time and, after each, spreads that column's rounding error over the
not-yet-quantised columns so that ``||X W^T - X Q^T||^2`` stays small. The error weighting is
the Hessian of that objective, ``H = 2 X^T X [K, K]``, used through the upper Cholesky factor
of its (damped) inverse. Columns go in order (no act-order); updates are applied lazily per
block of ``block`` columns. Scales are chosen per group from the *updated* weights at the
start of each group, as the paper's grouping does.

If ``H`` is the identity (uncorrelated, unit-variance inputs) the inverse is diagonal, no
error is propagated, and GPTQ equals round-to-nearest: ``tests/quant`` checks this, and that
on correlated inputs GPTQ's output error is below round-to-nearest's.
"""

from __future__ import annotations

import torch

from vlmbatch.quant.int4 import QMAX, QMIN, check_groups, quant_scale


class Hessian:
    """Running ``H = 2/n * sum x x^T`` over calibration rows ``x [.., K]`` (float64)."""

    def __init__(self, k: int) -> None:
        self.h = torch.zeros(k, k, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64).cpu()
        m = x.shape[0]
        if m == 0:
            return
        self.h *= self.n / (self.n + m)
        self.n += m
        self.h += (2.0 / self.n) * (x.t() @ x)


def gptq(w: torch.Tensor, h: torch.Tensor, group_size: int, damp: float = 0.01,
         block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]``, ``h [K, K]`` -> (q int8 [N, K], scale float32 [N, K/group_size])."""
    n, k = w.shape
    check_groups(k, group_size)
    block = max(group_size, block - block % group_size)  # groups never straddle blocks
    W = w.detach().to("cpu", torch.float64).clone()  # on the CPU, beside the Hessian
    H = h.detach().to(torch.float64).clone()
    dead = torch.diag(H) == 0  # inputs never active: weight irrelevant, keep H invertible
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros(n, k, dtype=torch.int8)
    scale = torch.zeros(n, k // group_size, dtype=torch.float32)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        W1 = W[:, b0:b1].clone()
        E1 = torch.zeros_like(W1)
        Hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                scale[:, g] = quant_scale(W1[:, i: i + group_size].float(), group_size)[:, 0]
            s = scale[:, col // group_size]  # float32, rounding as quant.int4.quantize does
            q = torch.clamp(torch.round(W1[:, i].float() / s), QMIN, QMAX)
            Q[:, col] = q.to(torch.int8)
            err = (W1[:, i] - (q * s).to(torch.float64)) / Hb[i, i]
            W1[:, i:] -= err[:, None] * Hb[i, i:][None, :]
            E1[:, i] = err
        W[:, b1:] -= E1 @ hinv[b0:b1, b1:]
    return Q, scale
