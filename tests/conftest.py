"""Shared fixtures: small random-weight InternVL checkpoints built and saved by the tests.

Nothing is downloaded: the config is written here, weights are random (seeded), and the
tokenizer is our own byte-level BPE trained on a few sentences. Every parameter is random
(``models/internvl/random.py``: weights drawn with a 0.1 spread, so logits are O(1), and
every bias, norm and layer scale moved off transformers' constants), and the vision tower
has q/k/v biases (InternViT-300M's ``attention_bias``), so the reference tests see a
dropped bias or a wrong head order (``tests/models/test_internvl_reference.py``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

# torchvision on the path (PYTHONPATH=DIR, `pip install --no-deps --target DIR
# torchvision==0.28.*`: tests/preprocessing/test_resize_reference.py): PyPI's Linux build is
# CUDA's, whose compiled ops cannot load beside our CPU torch, and its import then fails on
# registering their fake kernels (and so does transformers', which imports it when present).
# Imported first, with those registrations skipped: the transforms transformers' processors
# call are Python over torch and never touch those ops. Without torchvision: nothing.
if importlib.util.find_spec("torchvision") is not None:
    with mock.patch("torch.library.register_fake", lambda *a, **k: (lambda f: f)):
        import torchvision  # noqa: F401

from tests.jobs.ray_head import RayHead  # noqa: E402
from vlmbatch.models.internvl.random import save_random_internvl  # noqa: E402

# `--dtype auto` (the default) is float32 throughout the suite, in its subprocesses too:
# the parity tests compare against transformers' float32, and a result must not depend on
# whether the CPU running the suite has a bf16 unit. The rule itself: tests/engine/test_config.py
os.environ.setdefault("VLMBATCH_AUTO_DTYPE", "float32")


def make_model_dir(path: Path, *, tile: int = 56, patch: int = 14, vision_layers: int = 2,
                   norm_type: str = "layer_norm", qk_norm: bool = False,
                   mean_pooling: bool = True, attention_bias: bool = True, max_tiles: int = 6,
                   seed: int = 0, text: dict | None = None) -> Path:
    """Save a tiny random InternVL (HF-native) with our tokenizer into ``path``; returns it.
    ``text``: text-config keywords over the default Qwen2 ones (``TEXT_MODELS``)."""
    return save_random_internvl(
        path, tile=tile, patch=patch, max_tiles=max_tiles, seed=seed, initializer_range=0.1,
        vision=dict(hidden_size=32, num_hidden_layers=vision_layers, num_attention_heads=2,
                    intermediate_size=64, norm_type=norm_type, use_qk_norm=qk_norm,
                    use_mean_pooling=mean_pooling, attention_bias=attention_bias,
                    layer_scale_init_value=0.5),
        text={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 2048, **(text or {})})


# text models of the InternVL family beside the default Qwen2 (models/internvl/text.py), as
# make_model_dir's ``text``: every bias the config allows present (random.perturb moves
# them), so a dropped one shows. Llama's dynamic-NTK rotary past 32 positions: the
# test prompts (~40-70 tokens) are scaled.
TEXT_MODELS = {
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "attention_bias": True},
    "qwen3_no_bias": {"model_type": "qwen3", "head_dim": 8},  # InternVL3.5's releases
    "llama_dynamic": {"model_type": "llama", "attention_bias": True,
                      "max_position_embeddings": 32, "tie_word_embeddings": False,
                      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10000.0}},
}


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("internvl_random"))


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """One Ray head for the whole session (``tests/jobs/ray_head.py``; started by the first
    test that asks for it, stopped at the end). A test runs its job on it as a driver of its
    own, in a subprocess given ``ray_head.env`` (the head's token) and ``--address
    ray_head.address``: a driver's actors and tasks die with it, so tests do not share state
    through it, and none pays for a Ray start-up of its own (10-30 s each on 2 loaded cores).
    4 CPUs: a run takes at most 3 (2 prepare tasks, 1 model actor), and the actor of a
    driver just killed may hold one while Ray frees it. Tests that kill a node, or check that
    a run without an address starts its own instance, start their own."""
    pytest.importorskip("ray")
    head = RayHead(tmp_path_factory.mktemp("ray_head"), cpus=4)
    try:
        yield head
    finally:
        head.stop()


def reference_pixels(tiles: torch.Tensor, mean=(0.485, 0.456, 0.406),  # noqa: ANN001
                     std=(0.229, 0.224, 0.225)) -> torch.Tensor:
    """uint8 [N,S,S,3] -> normalised [N,3,S,S] the way InternVL's model card does it
    (ToTensor: /255, then Normalize)."""
    x = tiles.permute(0, 3, 1, 2).float() / 255.0
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (minutes each; not in CI)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
