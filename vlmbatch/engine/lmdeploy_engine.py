"""LMDeploy adapter (``--engine lmdeploy``): the same ``score`` interface on TurboMind.

GPU only, separate environment: lmdeploy pins ``torch<=2.12.1`` with CUDA and has no CPU
device, so it is imported only when this engine is built. **It has never run**: no machine
of ours has had lmdeploy and a GPU together. The request construction below is written
against lmdeploy 0.16.0's source (read, not run; file names in the comments) and unit-tested
without lmdeploy (``tests/engine/test_lmdeploy_engine.py``).

What lmdeploy 0.16.0 allows, and so what this adapter does:

- Prefix caching: ``TurbomindEngineConfig(enable_prefix_caching=True)``. For InternVL only
  TurboMind caches image prompts (``serve/core/vl_async_engine.py`` turns it off on the
  PyTorch backend). TurboMind keys an image by SHA-256 of its own ``pixel_values``
  (``turbomind/models/internvl.py: _resolve_fingerprint``); the public API has no way to pass
  our content hash or our tiles, so we pass the decoded image and lmdeploy re-tiles it with
  ``max_dynamic_patch`` set to our tiling's max tiles.
- Yes/no scores: ``GenerationConfig(max_new_tokens=1, output_logits='generation')`` gives
  ``Response.logits`` ``[gen_len, vocab]``; P(yes) is computed from it exactly as the torch
  engine does (``engine/scoring.py``). Top-N ``logprobs`` would not do: with greedy
  decoding TurboMind returns only the chosen token. ``ignore_eos`` keeps the logits of a
  first token that happens to be a stop token.
- AWQ/GPTQ checkpoints: ``model_format`` passed through (``'awq'``, ``'gptq'``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmbatch.engine.base import Engine, EngineStats
from vlmbatch.engine.config import ConfigError, EngineConfig, ModelConfig
from vlmbatch.engine.loading import image_plan_for, read_spec
from vlmbatch.engine.records import Item, MediaItem, Request, Score
from vlmbatch.engine.scoring import AnswerTokens, yes_no
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.internvl.family import InternVLSpec
from vlmbatch.preprocessing.prepare import TilingConfig


@dataclass(frozen=True)
class LMDeployConfig:
    model_format: str | None = None  # None: read from the checkpoint; 'awq' | 'gptq' | 'hf'
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8  # share of free GPU memory for the KV cache


def engine_config_kwargs(cfg: LMDeployConfig) -> dict[str, Any]:
    """Arguments of ``lmdeploy.TurbomindEngineConfig`` (lmdeploy/messages.py)."""
    kw: dict[str, Any] = {"enable_prefix_caching": True, "tp": cfg.tp,
                          "cache_max_entry_count": cfg.cache_max_entry_count}
    for name in ("model_format", "session_len", "max_batch_size"):
        if getattr(cfg, name) is not None:
            kw[name] = getattr(cfg, name)
    return kw


def gen_config_kwargs(max_new_tokens: int) -> dict[str, Any]:
    """Arguments of ``lmdeploy.GenerationConfig``: greedy, first-token logits returned."""
    return {"max_new_tokens": max(1, max_new_tokens), "do_sample": False,
            "output_logits": "generation", "ignore_eos": max_new_tokens <= 1}


def gen_configs(generation_config: Any, limits: list[int]) -> Any:
    """What ``pipe.infer(prompts, gen_config=...)`` takes for these per-request answer-token
    limits: one ``GenerationConfig`` when they agree, else a list, one per prompt (lmdeploy's
    ``Pipeline.infer`` accepts ``GenerationConfig | list[GenerationConfig]`` and pairs a list
    with the prompts), so long and short answers share one continuous batch."""
    made = {n: generation_config(**gen_config_kwargs(n)) for n in set(limits)}
    return made[limits[0]] if len(made) == 1 else [made[n] for n in limits]


def build_messages(pixels: np.ndarray, question: str, max_tiles: int) -> list[dict[str, Any]]:
    """OpenAI-style messages lmdeploy accepts (serve/processors/multimodal.py): an
    ``image_url`` part holding a PIL image, with ``max_dynamic_patch`` as a per-image
    parameter read by InternVL's preprocess, then the question."""
    image = Image.fromarray(pixels)
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image, "max_dynamic_patch": max_tiles}},
        {"type": "text", "text": question},
    ]}]


def score_response(response: Any, answers: AnswerTokens, image_tokens: int,
                   want_text: bool) -> Score:
    """``lmdeploy.Response`` -> Score, from the logits of the first generated position."""
    if getattr(response, "finish_reason", None) == "error":
        raise RuntimeError(f"lmdeploy: {getattr(response, 'error_message', 'unknown error')}")
    logits = torch.as_tensor(response.logits)[:1].float()  # [1, V]
    p_yes, margin = yes_no(logits, answers)
    return Score(float(p_yes[0]), float(margin[0]), image_tokens,
                 response.text if want_text else None)


def require_lmdeploy() -> Any:
    try:  # optional dependency: a separate GPU env
        import lmdeploy
    except ImportError as e:
        raise ImportError(
            "--engine lmdeploy needs lmdeploy (CUDA GPU, separate env: it pins "
            "torch<=2.12.1): pip install 'vlmbatch[lmdeploy]' there") from e
    return lmdeploy


class LMDeployEngine(Engine):
    """Scores (image, question) requests with an lmdeploy TurboMind pipeline. lmdeploy keeps
    its own prefix cache (``Response.cached_tokens`` reports its hits), so ``summary()`` has
    no hit rate."""

    def __init__(self, model_path: str, tokenizer: Any, answers: AnswerTokens,
                 tokens_per_tile: int, image_plan: TilingConfig, max_new_tokens: int = 0,
                 cfg: LMDeployConfig | None = None) -> None:
        lmdeploy = require_lmdeploy()
        self.cfg = cfg or LMDeployConfig()
        self.pipe = lmdeploy.pipeline(
            model_path, backend_config=lmdeploy.TurbomindEngineConfig(
                **engine_config_kwargs(self.cfg)))
        self.lmdeploy = lmdeploy
        self.max_new_tokens = max_new_tokens
        self.answers = answers
        self.tokens_per_tile = tokens_per_tile
        # lmdeploy re-tiles the decoded image itself, so the plan keeps the pixels
        self.image_plan = dataclasses.replace(image_plan, keep_pixels=True)
        self.max_tiles = image_plan.max_tiles
        self.stats = EngineStats()

    def score(self, images: list[Item], requests: list[Request]) -> list[Score]:
        if any(r.choices or r.system is not None for r in requests):
            raise ConfigError("label sets (choices) and system turns are asked by the torch "
                              "engine (--engine torch), not lmdeploy")
        prompts, stills = [], []
        for r in requests:
            im = images[r.image]
            if isinstance(im, MediaItem):
                raise ConfigError("several images or a clip per item are asked by the torch "
                                  "engine (--engine torch), not lmdeploy")
            if im.pixels is None:
                raise ValueError("the lmdeploy engine needs PreparedImage.pixels")
            prompts.append(build_messages(im.pixels, r.question, self.max_tiles))
            stills.append(im)
        limits = [self.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
                  for r in requests]
        responses = self.pipe.infer(prompts,
                                    gen_config=gen_configs(self.lmdeploy.GenerationConfig, limits))
        return [score_response(resp, self.answers, len(im.rows) * self.tokens_per_tile, n > 0)
                for im, resp, n in zip(stills, responses, limits)]


def build_lmdeploy(model_cfg: ModelConfig, engine_cfg: EngineConfig,
                   threads: int | None = None) -> LMDeployEngine:
    """An lmdeploy TurboMind pipeline on an InternVL checkpoint (``threads``: unused, the
    model runs on the GPU)."""
    require_lmdeploy()  # before reading the model: fail fast and say what to install
    family, spec = read_spec(model_cfg.path)
    if not isinstance(spec, InternVLSpec):
        raise ModelError(f"--engine lmdeploy is wired for InternVL checkpoints only, not "
                         f"{spec.model_type!r}")
    tok = family.load_tokenizer(model_cfg.model_dir)
    plan = image_plan_for(family, spec, model_cfg)
    assert isinstance(plan, TilingConfig)
    answers = AnswerTokens.from_words(tok, engine_cfg.yes_words, engine_cfg.no_words)
    return LMDeployEngine(str(model_cfg.model_dir), tok, answers, spec.tokens_per_tile, plan,
                          engine_cfg.max_new_tokens)
