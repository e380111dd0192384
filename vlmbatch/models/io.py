"""Reading a checkpoint folder: its JSON files (``config_io.py``) and
safetensors weights, with errors that say what to do. Every model family loads through here,
so a truncated file or a config that does not fit its weights reads the same whatever the
family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from vlmbatch.models.config_io import ModelError, read_json, unreadable_weights


def raw_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (one file or a sharded index), keys as its files spell
    them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(path / f)))
        except SafetensorError as e:
            raise unreadable_weights(path / f, e) from e
    return sd


class LoadsHF(Protocol):
    def load_hf(self, sd: dict[str, torch.Tensor]) -> None: ...


class _ReadLog(dict):
    """A state dict that remembers the last key read."""
    last: str | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        self.last = key
        return super().__getitem__(key)


def load_weights(module: LoadsHF, sd: dict[str, torch.Tensor], path: Path) -> None:
    """``module.load_hf(sd)``; ModelError naming the weight if config.json does not fit it."""
    log = _ReadLog(sd)
    try:
        module.load_hf(log)
    except KeyError as e:  # weights the config asks for are not in the checkpoint
        raise ModelError(f"{path}: {e.args[0]}; config.json and the weights must come from "
                         "the same checkpoint: restore its original config.json") from e
    except RuntimeError as e:  # copy_ of a tensor of another shape (not, e.g., out of memory)
        if log.last is None or "size" not in str(e) and "shape" not in str(e):
            raise
        raise ModelError(f"{path}: weight {log.last} has shape {tuple(sd[log.last].shape)}, "
                         f"which the sizes in config.json do not fit ({e}); config.json and "
                         "the weights must come from the same checkpoint: restore its original "
                         "config.json") from e
