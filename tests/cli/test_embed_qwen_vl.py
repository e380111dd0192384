"""Qwen-VL and ColQwen2 checkpoints through every way into embeddings: ``vlmbatch embed``, the
Python API, ``submit --task embed``; ColQwen2's multi-vector default, ``--maxsim`` and the
refusal of ``run``. The vectors themselves are checked against transformers in
``tests/engine/test_embed_reference_qwen.py`` and ``test_colqwen2.py``; here every way in
gives the same ones. Tiny random checkpoints (``tests/models/qwen_vl_helpers.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

import vlmbatch
from tests.jobs.test_embed_job import embed_manifest
from tests.models.qwen_vl_helpers import save_colqwen2_checkpoint, save_engine_checkpoint
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_engine_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def col_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_colqwen2_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("colqwen2"))


@pytest.fixture()
def pngs(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    for name, (h, w) in {"a.png": (40, 60), "b.png": (90, 200)}.items():
        cv2.imwrite(str(tmp_path / name), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        out.append(tmp_path / name)
    return out


def lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def test_embed_cli_equals_the_api(qwen_dir: Path, pngs: list[Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    texts = ["a red circle", "a blue square"]
    assert main(["embed", *texts, "--model", str(qwen_dir)]) == EXIT_OK
    got_t = np.array([r["embedding"] for r in lines(capsys.readouterr().out)], np.float32)
    npy = tmp_path / "v.npy"
    assert main(["embed", "--images", *map(str, pngs), "-o", str(npy), "--model",
                 str(qwen_dir)]) == EXIT_OK
    vlm = vlmbatch.VLM(qwen_dir)
    want_t, want_i = vlm.embed(texts=texts), vlm.embed(images=pngs)  # batched as the CLI's
    assert want_t.shape == want_i.shape == (2, 64)
    assert np.abs(got_t - want_t).max() == 0 and np.abs(np.load(npy) - want_i).max() == 0
    both = vlm.embed(texts=texts, images=pngs)  # one batch of mixed prompts: rounding only
    assert np.abs(both - np.concatenate([want_t, want_i])).max() <= 1e-6


def test_submit_task_embed(qwen_dir: Path, tmp_path: Path) -> None:
    """A job's stored vectors = ``vlmbatch embed --manifest`` on the same manifest."""
    m = embed_manifest(tmp_path, 4)
    job = tmp_path / "job"
    assert main(["submit", str(m), "--task", "embed", "--job", str(job), "--model",
                 str(qwen_dir), "--no-progress", "--images-per-batch", "2"]) == EXIT_OK
    assert main(["run", str(job), "--no-progress"]) == EXIT_ITEM_ERRORS  # the missing image
    direct, out = tmp_path / "d.jsonl", tmp_path / "r.jsonl"
    assert main(["embed", "--manifest", str(m), "-o", str(direct), "--images-per-batch", "2",
                 "--model", str(qwen_dir)]) == EXIT_ITEM_ERRORS
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    assert out.read_text() == direct.read_text()
    assert len(lines(out.read_text())) == 5


def test_colqwen2_is_multi_vector_and_refused_by_run(col_dir: Path, pngs: list[Path],
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    assert main(["embed", "a red circle", "--model", str(col_dir)]) == EXIT_OK
    out, err = capsys.readouterr()
    vec = np.array(lines(out)[0]["embedding"], np.float32)
    vlm = vlmbatch.VLM(col_dir)
    (want,) = [e.vector for e in vlm.embed_many(["a red circle"])]
    assert want is not None and vec.shape == want.shape and want.shape[1] == 128
    assert np.abs(vec - want).max() == 0 and "declares no" not in err
    with pytest.raises(ValueError, match="embed_many"):
        vlm.embed(texts=["a red circle"])
    assert vlm.embed(texts=["a red circle"], pooling="mean").shape == (1, 64)
    assert main(["embed", "a red circle", "--no-multi-vector", "--model", str(col_dir)]) == EXIT_OK
    pooled = np.array(lines(capsys.readouterr().out)[0]["embedding"], np.float32)
    assert np.abs(pooled - vlm.embed(texts=["a red circle"], multi_vector=False)[0]).max() == 0

    (tmp_path / "q.txt").write_text("a red circle\nis it blue?\n")
    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"image": str(p)}) + "\n" for p in pngs))
    assert main(["embed", "--maxsim", str(tmp_path / "q.txt"), str(docs), "--model",
                 str(col_dir)]) == EXIT_OK
    got = np.array([[float(x) for x in ln.split()] for ln in
                    capsys.readouterr().out.splitlines()])
    q = [e.vector for e in vlm.embed_many(["a red circle", "is it blue?"])]
    d = [e.vector for e in vlm.embed_many([(p, None) for p in pngs])]
    assert got.shape == (2, 2) and np.abs(got - vlmbatch.maxsim(q, d)).max() <= 5e-5

    (tmp_path / "m.jsonl").write_text(json.dumps({"image": str(pngs[0]),
                                                  "questions": ["Red?"]}) + "\n")
    assert main(["run", str(tmp_path / "m.jsonl"), "--model", str(col_dir)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "is an embedding model" in err and "vlmbatch embed" in err
