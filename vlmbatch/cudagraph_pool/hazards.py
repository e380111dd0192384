"""Find, on the CPU, what would break CUDA graph capture of a callable.

A CUDA graph records kernels only. Work the host must do in the middle of a forward cannot be
captured, and torch raises ``operation not permitted when stream is capturing`` on the GPU
(pytorch#91302 is the classic case: a ``torch.tensor([...], device="cuda")`` inside
``forward`` is a host-to-device copy). Those ops are visible at torch's dispatcher whatever the
device, so ``capture_hazards(fn, x)`` runs ``fn`` on the CPU under a dispatch mode and lists
them, which lets a CPU test guard what the graph pool captures.

Like ``GraphPool.capture``, it calls ``fn`` once untraced first (the warm-up, where lazy
one-time set-up may happen) and records the second call, the one a capture would see.

Caught: tensors built from host data (``lift_fresh``: ``torch.tensor``/``as_tensor``), reads of
a tensor's value on the host (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``), ops whose
output shape depends on the data (``nonzero``, ``masked_select``, ``unique``, boolean-mask
indexing), and transfers to a device other than the input's. Not caught: ``.tolist()`` and
``torch.from_numpy`` (nothing is dispatched), transfers that are no-ops on the CPU (``.to(dev)``
with ``dev`` the CPU), and Python control flow on host values, which capture would freeze.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_WHY = {
    aten.lift_fresh.default: "tensor built from host data (torch.tensor / as_tensor): a "
                             "host-to-device copy",
    aten.lift_fresh_copy.default: "tensor built from host data: a host-to-device copy",
    aten.item.default: "host reads a tensor's value (.item(), int(), float()): synchronises",
    aten.is_nonzero.default: "host reads a tensor's truth value (bool(), if t:): synchronises",
    aten._local_scalar_dense.default: "host reads a tensor's value: synchronises",
    aten.nonzero.default: "output shape depends on the data (nonzero / boolean indexing)",
    aten.masked_select.default: "output shape depends on the data (masked_select)",
    aten._unique2.default: "output shape depends on the data (unique)",
    aten.unique_dim.default: "output shape depends on the data (unique)",
    aten.unique_consecutive.default: "output shape depends on the data (unique_consecutive)",
}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        why = _WHY.get(func)
        if func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            why = "output shape depends on the data (boolean-mask indexing)"
        dev = args[1] if func is aten.to.device else kwargs.get("device")
        if func in (aten._to_copy.default, aten.to.device) and dev is not None \
                and torch.device(dev) != args[0].device:
            why = f"device transfer to {dev}"
        if why is not None:
            self.found.append(f"{func}: {why}")
        return func(*args, **kwargs)


def capture_hazards(fn: Callable[..., object], *args: object) -> list[str]:
    """Ops of ``fn(*args)`` (second call) that CUDA graph capture cannot record; [] if none."""
    with torch.inference_mode():
        fn(*args)
        with _Recorder() as rec:
            fn(*args)
    return rec.found
