"""``--compile-llm``: the decoder's prefill through ``torch.compile`` (dynamic shapes)
answers as eager does (fp32, CPU, 1e-5), across batches of different sizes and prompt
lengths and after cached prefixes (one compilation serves them all)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmbatch.engine.config import EngineConfig
from vlmbatch.engine.loading import load_model
from vlmbatch.engine.records import Request
from vlmbatch.engine.torch_engine import TorchEngine
from vlmbatch.preprocessing.prepare import prepare


def test_compiled_prefill_equals_eager(random_model_dir: Path) -> None:
    model = load_model(random_model_dir)
    rng = np.random.default_rng(5)
    ims = [prepare(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), model.spec.tiling)
           for w, h in [(56, 56), (150, 60), (40, 130)]]
    reqs = [Request(i, q) for i in range(3) for q in ("is there a red shape?", "no", "a circle?")]
    compiled = TorchEngine(model, EngineConfig(compile_llm=True, max_batch_tokens=400))
    eager = TorchEngine(model, EngineConfig(max_batch_tokens=400))
    for _ in range(2):  # the second round: cached prefixes, other batch shapes
        a, b = compiled.score(ims, reqs), eager.score(ims, reqs)
        assert max(abs(x.margin - y.margin) for x, y in zip(a, b)) <= 1e-5
    assert compiled.runner.prefill_fn is not model.llm.prefill
