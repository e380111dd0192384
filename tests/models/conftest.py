"""Session fixtures: one tiny random checkpoint per Qwen-VL kind, saved by the test, loaded
both by transformers (the reference) and by our modules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.models.qwen_vl_helpers import KINDS, save_checkpoint
from vlmbatch.models.qwen_vl.load import QwenVLModel, load_qwen_vl


@dataclass
class Pair:
    path: Path
    ref: torch.nn.Module  # transformers' ...ForConditionalGeneration
    ours: QwenVLModel


@pytest.fixture(scope="session")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    from transformers import AutoModelForImageTextToText

    out = {}
    for kind in KINDS:
        path = save_checkpoint(kind, tmp_path_factory.mktemp(kind))
        ref = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
        out[kind] = Pair(path, ref, load_qwen_vl(path))
    return out


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, pairs: dict[str, Pair]) -> Pair:
    return pairs[request.param]
