"""Grouped-query attention with a padding mask: SDPA's ``enable_gqa`` vs K/V repeated per head.

The text decoder (``vlmbatch/models/decoder.py``) uses ``enable_gqa`` (``EXPAND_KV`` forces
the other); this prints both side by side, in one process, at Qwen2-0.5B's head layout (14
query heads, 2 key/value heads, head dim 64) for a scoring prefill (prompts after a cached
image prefix) and a decode step, and checks that the two agree (max abs diff within
``--check-tol``: 1e-5 in fp32, 2e-2 in bf16/fp16; exit 1 after the table past it). On CUDA
it also says whether the memory-efficient kernel accepts each form.

    python bench/attention.py                      # CPU
    python bench/attention.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checks import Checks  # noqa: E402

H, K, D = 14, 2, 64
SHAPES = {  # name: (batch, new tokens T, cached tokens P)
    "prefill 16 x 32 after 512": (16, 32, 512),
    "prefill 4 x 1024": (4, 1024, 0),
    "decode 64 x 1 after 600": (64, 1, 600),
}


def inputs(b: int, t: int, p: int, device: str, dtype: torch.dtype):  # noqa: ANN201
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, H, t, D, generator=g).to(device, dtype)
    k = torch.randn(b, K, p + t, D, generator=g).to(device, dtype)
    v = torch.randn(b, K, p + t, D, generator=g).to(device, dtype)
    lengths = torch.randint(max(1, (p + t) // 2), p + t + 1, (b,), generator=g)
    keys = torch.arange(p + t)[None, None, :] < lengths[:, None, None]  # padding
    causal = torch.arange(p + t)[None, :] <= (p + torch.arange(t))[:, None]
    return q, k, v, (keys & causal[None])[:, None].to(device)  # mask [B, 1, T, P+T]


def gqa(q, k, v, m):  # noqa: ANN001, ANN201
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)


def expanded(q, k, v, m):  # noqa: ANN001, ANN201
    return F.scaled_dot_product_attention(q, k.repeat_interleave(H // K, 1),
                                          v.repeat_interleave(H // K, 1), attn_mask=m)


def timed(fn, args, reps: int, cuda: bool) -> float:  # noqa: ANN001
    fn(*args)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def efficient_ok(fn, args) -> str:  # noqa: ANN001
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            fn(*args)
        return "yes"
    except RuntimeError:
        return "no"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check-tol", type=float, default=None,
                    help="bound on the two forms' max abs diff (default 1e-5 in fp32, else 2e-2)")
    args = ap.parse_args()
    tol = args.check_tol if args.check_tol is not None else (
        1e-5 if args.dtype == "float32" else 2e-2)
    checks = Checks()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"GQA attention with a mask, {H} q heads / {K} kv heads, d {D}, {args.dtype}, {where}")
    print("| shape | enable_gqa ms | expanded K/V ms | expanded speed-up | max abs diff |"
          + (" mem-efficient takes gqa / expanded |" if cuda else ""))
    print("|---|---|---|---|---|" + ("---|" if cuda else ""))
    with torch.inference_mode():
        for name, (b, t, p) in SHAPES.items():
            x = inputs(b, t, p, args.device, dtype)
            diff = (gqa(*x).float() - expanded(*x).float()).abs().max().item()
            a, e = timed(gqa, x, args.reps, cuda), timed(expanded, x, args.reps, cuda)
            extra = f" {efficient_ok(gqa, x)} / {efficient_ok(expanded, x)} |" if cuda else ""
            print(f"| {name} | {a:.3f} | {e:.3f} | {a / e:.2f}x | {diff:.1e} |{extra}")
            checks.verdict(diff <= tol, f"{name}: enable_gqa = expanded K/V within {tol:g}: "
                           f"max abs diff {diff:.1e}")
    print(f"\ncheck: the two forms agree within {tol:g} on every shape: "
          f"{'FAILED' if checks.failed else 'OK'}")
    checks.exit()


if __name__ == "__main__":
    main()
