"""A Qwen-VL checkpoint through every way in: ``vlmbatch run`` (lines = transformers' P(yes)),
the Python API, a job, Ray, ``eval --limit``, the image-token budget, and the messages for
options and model types that do not apply. Tiny random checkpoints with our tokenizer
(``tests/models/qwen_vl_helpers.py``), one per kind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vlmbatch
from tests.jobs.test_job import make_manifest
from tests.models.qwen_vl_helpers import KINDS, reference_pixels, save_engine_checkpoint
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.engine.build import build_engine
from vlmbatch.engine.config import EngineConfig, ModelConfig
from vlmbatch.jobs.folder import status
from vlmbatch.preprocessing.decode import decode


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {k: save_engine_checkpoint(k, tmp_path_factory.mktemp(k)) for k in KINDS}


@pytest.fixture(params=KINDS)
def qwen_dir(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Path:
    return checkpoints[request.param]


def run_lines(manifest: Path, model: Path, out: Path, *options: str) -> list[dict]:
    assert main(["run", str(manifest), "--model", str(model), "--out", str(out),
                 "--images-per-batch", "2", "--no-progress", *options]) == EXIT_OK
    return [json.loads(x) for x in out.read_text().splitlines()]


def reference_p_yes(model: Path, manifest: Path, lines: list[dict]) -> list[float]:
    """transformers' P(yes) for each line: its image decoded and resized by our plan, the
    prompt our builder makes, the forward of ``...ForConditionalGeneration``."""
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(str(model)).eval()
    engine = build_engine(ModelConfig(model), EngineConfig())
    m = engine.model  # type: ignore[attr-defined]
    items = {json.loads(x)["id"]: json.loads(x)["image"] for x in manifest.read_text().splitlines()}
    yes, no = list(engine.answers.yes_ids), list(engine.answers.no_ids)  # type: ignore[attr-defined]
    out = []
    for ln in lines:
        im = engine.image_plan.prepare(decode((manifest.parent / items[ln["id"]]).read_bytes()))
        ids = torch.tensor([m.prompts.build(ln["question"], im).ids])
        with torch.no_grad():
            logits = ref(input_ids=ids, mm_token_type_ids=(ids == m.spec.image_token_id).int(),
                         pixel_values=reference_pixels(torch.from_numpy(im.rows),
                                                       m.spec.vision.mean, m.spec.vision.std),
                         image_grid_thw=torch.tensor([im.grid.dims])).logits[0, -1]
        out.append(float(torch.sigmoid(logits[yes].logsumexp(-1) - logits[no].logsumexp(-1))))
    return out


def test_run_lines_equal_transformers(qwen_dir: Path, tmp_path: Path) -> None:
    m = make_manifest(tmp_path, 3)
    lines = run_lines(m, qwen_dir, tmp_path / "out.jsonl")
    assert len(lines) == 6 and all(ln["error"] is None for ln in lines)
    want = reference_p_yes(qwen_dir, m, lines)
    assert max(abs(ln["p_yes"] - w) for ln, w in zip(lines, want)) <= 1e-4
    assert all(ln["answer"] == ("yes" if ln["p_yes"] >= 0.5 else "no") for ln in lines)


def test_api_and_job_give_the_run_lines(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = checkpoints["qwen3_vl"]
    m = make_manifest(tmp_path, 3)
    direct = run_lines(m, model, tmp_path / "direct.jsonl")
    vlm = vlmbatch.VLM(model, images_per_batch=2)  # batched as the run: the same floats
    api = [a.line() for a in vlm.ask([str(tmp_path / f"{i}.png") for i in range(3)],
                                     ["Red?", "A circle?"])]
    assert [(a["p_yes"], a["image_tokens"]) for a in api] == \
        [(d["p_yes"], d["image_tokens"]) for d in direct]
    job = tmp_path / "job"
    assert main(["submit", str(m), "--job", str(job), "--model", str(model),
                 "--images-per-batch", "2", "--no-progress"]) == EXIT_OK
    assert main(["run", str(job), "--no-progress"]) == EXIT_OK
    out = tmp_path / "job.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    assert out.read_text() == (tmp_path / "direct.jsonl").read_text()
    assert status(job).done == 3


@pytest.mark.slow
def test_ray_gives_the_run_lines(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("ray")
    model = checkpoints["qwen2_5_vl"]
    m = make_manifest(tmp_path, 3)
    direct = run_lines(m, model, tmp_path / "direct.jsonl")
    ray = run_lines(m, model, tmp_path / "ray.jsonl", "--executor", "ray", "--model-cpus", "1")
    for a, b in zip(ray, direct):  # another torch thread count: float noise only
        assert a["image_tokens"] == b["image_tokens"] and abs(a["p_yes"] - b["p_yes"]) <= 1e-5


def test_eval_limit(checkpoints: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", "--model", str(checkpoints["qwen2_vl"]), "--limit", "12",
                 "--no-progress"]) == EXIT_OK
    assert "yes/no accuracy" in capsys.readouterr().out


def test_max_image_tokens_lowers_the_resize(checkpoints: dict[str, Path],
                                            tmp_path: Path) -> None:
    model = checkpoints["qwen2_5_vl"]
    rng = np.random.default_rng(1)
    import cv2

    cv2.imwrite(str(tmp_path / "big.png"), rng.integers(0, 256, (300, 420, 3), np.uint8))
    (tmp_path / "m.jsonl").write_text(json.dumps({"id": "b", "image": "big.png",
                                                  "questions": ["Red?"]}) + "\n")
    full = run_lines(tmp_path / "m.jsonl", model, tmp_path / "a.jsonl")
    capped = run_lines(tmp_path / "m.jsonl", model, tmp_path / "b.jsonl",
                       "--max-image-tokens", "12")
    assert capped[0]["image_tokens"] <= 12 < full[0]["image_tokens"] <= 40


def test_options_and_model_types_that_do_not_apply(checkpoints: dict[str, Path],
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    m = make_manifest(tmp_path, 1)
    model = checkpoints["qwen2_vl"]
    assert main(["run", str(m), "--model", str(model), "--max-tiles", "2"]) == EXIT_BAD_INPUT
    assert "--max-image-tokens" in capsys.readouterr().err
    assert main(["run", str(m), "--model", str(model),
                 "--max-image-tokens", "1"]) == EXIT_BAD_INPUT
    assert "min_pixels" in capsys.readouterr().err
    known = "'internvl', 'internvl_chat', 'qwen2_vl', 'qwen2_5_vl', 'qwen3_vl'"
    for model_type, says in (("llava", known),
                             ("qwen3_vl_moe", "mixture-of-experts")):
        other = tmp_path / model_type
        other.mkdir()
        (other / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert main(["run", str(m), "--model", str(other)]) == EXIT_BAD_INPUT
        assert says in capsys.readouterr().err
