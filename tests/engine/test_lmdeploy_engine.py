"""The LMDeploy adapter's request construction and scoring, without lmdeploy.

These test our side only (arguments, messages, logits -> P(yes)); lmdeploy itself cannot be
installed here (CUDA, torch<=2.12.1). ``test_real_lmdeploy_types`` runs where it can.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vlmbatch.cli.commands import EXIT_BAD_INPUT
from vlmbatch.cli.main import main
from vlmbatch.engine.lmdeploy_engine import (
    LMDeployConfig,
    build_messages,
    engine_config_kwargs,
    gen_config_kwargs,
    gen_configs,
    score_response,
)
from vlmbatch.engine.scoring import AnswerTokens

HAS_LMDEPLOY = importlib.util.find_spec("lmdeploy") is not None


def test_engine_config_turns_prefix_caching_on_and_passes_formats() -> None:
    kw = engine_config_kwargs(LMDeployConfig(model_format="awq", session_len=4096))
    assert kw["enable_prefix_caching"] is True
    assert kw["model_format"] == "awq" and kw["session_len"] == 4096
    assert "max_batch_size" not in engine_config_kwargs(LMDeployConfig())


def test_gen_config_asks_for_first_token_logits() -> None:
    assert gen_config_kwargs(0) == {"max_new_tokens": 1, "do_sample": False,
                                    "output_logits": "generation", "ignore_eos": True}
    assert gen_config_kwargs(32)["max_new_tokens"] == 32
    assert gen_config_kwargs(32)["ignore_eos"] is False


def test_per_request_answer_lengths_go_in_one_infer_call(monkeypatch) -> None:  # noqa: ANN001
    """A question's own max_new_tokens reaches lmdeploy as a per-prompt GenerationConfig
    list (one call, one continuous batch); only rows that asked for text get it."""
    import sys
    from types import ModuleType

    from vlmbatch.engine.lmdeploy_engine import LMDeployEngine
    from vlmbatch.engine.records import Request
    from vlmbatch.preprocessing.prepare import TilingConfig

    calls = []

    class Pipe:
        def infer(self, prompts, gen_config):  # noqa: ANN001, ANN202
            calls.append(gen_config)
            return [SimpleNamespace(logits=torch.zeros(1, 10), text=f"t{j}",
                                    finish_reason="stop") for j in range(len(prompts))]

    fake = ModuleType("lmdeploy")
    fake.pipeline = lambda path, backend_config: Pipe()  # type: ignore[attr-defined]
    fake.TurbomindEngineConfig = dict  # type: ignore[attr-defined]
    fake.GenerationConfig = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    engine = LMDeployEngine("m", None, AnswerTokens((1,), (2,)), 16,
                            TilingConfig(tile_size=56, max_tiles=6), max_new_tokens=0)
    assert engine.image_plan.keep_pixels and engine.max_tiles == 6
    px = np.zeros((20, 20, 3), dtype=np.uint8)
    im = SimpleNamespace(pixels=px, rows=np.zeros((1, 56, 56, 3), np.uint8))  # one tile
    got = engine.score([im], [Request(0, "a?"), Request(0, "why?", 64), Request(0, "b?")])
    assert [s.text for s in got] == [None, "t1", None]
    (cfg,) = calls
    assert [c["max_new_tokens"] for c in cfg] == [1, 64, 1] and cfg[0] is cfg[2]
    assert gen_configs(dict, [0, 0]) == gen_config_kwargs(0)  # all alike: one config


def test_messages_carry_the_decoded_image_and_tile_cap() -> None:
    px = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    (msg,) = build_messages(px, "Is it red?", max_tiles=6)
    img_part, text_part = msg["content"]
    assert msg["role"] == "user" and text_part == {"type": "text", "text": "Is it red?"}
    assert img_part["type"] == "image_url"
    assert img_part["image_url"]["max_dynamic_patch"] == 6
    assert np.array_equal(np.asarray(img_part["image_url"]["url"]), px)


def test_score_from_first_generated_logits() -> None:
    answers = AnswerTokens(yes_ids=(3, 4), no_ids=(5,))
    logits = torch.randn(2, 10)
    s = score_response(SimpleNamespace(logits=logits, text="yes, because", finish_reason="stop"),
                       answers, image_tokens=256, want_text=True)
    ly, ln = torch.logsumexp(logits[0, [3, 4]], 0), logits[0, 5]
    assert abs(s.margin - float(ly - ln)) < 1e-6
    assert abs(s.p_yes - float(torch.exp(ly) / (torch.exp(ly) + torch.exp(ln)))) < 1e-6
    assert s.text == "yes, because" and s.image_tokens == 256
    with pytest.raises(RuntimeError, match="out of memory"):
        score_response(SimpleNamespace(finish_reason="error", error_message="out of memory"),
                       answers, 1, False)


@pytest.mark.skipif(HAS_LMDEPLOY, reason="checks the message shown when lmdeploy is missing")
def test_cli_says_how_to_get_lmdeploy(tmp_path, capsys) -> None:  # noqa: ANN001
    m = tmp_path / "m.jsonl"
    m.write_text('{"image": "x.png", "questions": ["q?"]}\n')
    assert main(["run", str(m), "--engine", "lmdeploy"]) == EXIT_BAD_INPUT
    assert "lmdeploy" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_LMDEPLOY, reason="lmdeploy is not installed (GPU env only)")
def test_real_lmdeploy_types() -> None:
    """Our keyword arguments build lmdeploy's real config types and land where we meant."""
    import lmdeploy

    eng = lmdeploy.TurbomindEngineConfig(**engine_config_kwargs(LMDeployConfig(model_format="awq")))
    assert (eng.enable_prefix_caching, eng.model_format, eng.tp) == (True, "awq", 1)
    gen = lmdeploy.GenerationConfig(**gen_config_kwargs(0))
    assert (gen.max_new_tokens, gen.do_sample, gen.output_logits) == (1, False, "generation")
