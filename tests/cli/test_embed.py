"""``vlmbatch embed`` end to end on a random-weight model: lines, stdin, -sim, images and
manifests to JSONL / Parquet / .npy, Matryoshka refusal, --maxsim, and the messages between
chat and embedding checkpoints; the Python API gives the same vectors."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

import vlmbatch
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main


def lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (40, 60), "b.png": (90, 200)}.items():
        cv2.imwrite(str(tmp_path / name), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    rows = [{"id": "a", "image": "a.png"}, {"id": "t", "text": "a red circle"},
            {"id": "both", "image": "b.png", "text": "a blue square"},
            {"id": "gone", "image": "missing.png"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_texts_give_one_line_each(random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    assert main(["embed", "a red circle", "a blue square", "--model",
                 str(random_model_dir)]) == EXIT_OK
    out, err = capsys.readouterr()
    rows = lines(out)
    assert [sorted(r) for r in rows] == [["embedding", "index", "tokens"]] * 2
    assert [r["index"] for r in rows] == [0, 1] and all(r["tokens"] > 0 for r in rows)
    for r in rows:
        assert abs(np.linalg.norm(r["embedding"]) - 1) < 1e-5
    assert "declares no embedding pooling" in err  # a chat model: said so
    want = vlmbatch.VLM(random_model_dir).embed(texts=["a red circle", "a blue square"])
    assert np.abs(np.array([r["embedding"] for r in rows], np.float32) - want).max() == 0


def test_stdin_and_sim(random_model_dir: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("sys.stdin", io.StringIO("a red circle\n\na blue square\nyes\n"))
    assert main(["embed", "-sim", "--model", str(random_model_dir)]) == EXIT_OK
    rows = [[float(x) for x in ln.split()] for ln in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(len(r) == 3 for r in rows)  # the blank line skipped
    m = np.array(rows)
    assert np.allclose(np.diag(m), 1.0) and np.allclose(m, m.T)
    v = vlmbatch.VLM(random_model_dir).embed(texts=["a red circle", "a blue square", "yes"])
    assert np.abs(m - v @ v.T).max() <= 5e-5  # printed to 4 decimals


def test_images_to_npy_and_manifest_to_parquet(random_model_dir: Path, files: Path,
                                               capsys) -> None:  # noqa: ANN001
    npy = files / "v.npy"
    assert main(["embed", "--images", str(files / "a.png"), str(files / "b.png"), "-o",
                 str(npy), "--model", str(random_model_dir)]) == EXIT_OK
    arr = np.load(npy)
    assert arr.shape == (2, 32) and arr.dtype == np.float32
    pq = pytest.importorskip("pyarrow.parquet")
    out = files / "v.parquet"
    assert main(["embed", "--manifest", str(files / "m.jsonl"), "-o", str(out), "--model",
                 str(random_model_dir)]) == EXIT_ITEM_ERRORS  # missing.png
    table = pq.read_table(out)
    pa = pytest.importorskip("pyarrow")
    t = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(t) and t.list_size == 32 and t.value_type == pa.float32()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["a", "t", "both", "gone"]
    assert rows[3]["embedding"] is None and "missing.png" in rows[3]["error"]
    # another batch (other inputs, other padding): equal to float noise
    assert np.abs(np.array(rows[0]["embedding"], np.float32) - arr[0]).max() <= 1e-6
    jsonl = files / "v.jsonl"
    main(["embed", "--manifest", str(files / "m.jsonl"), "-o", str(jsonl), "--model",
          str(random_model_dir)])
    got = lines(jsonl.read_text())
    assert {k: v for k, v in got[1].items() if k != "embedding"} == {
        "index": 1, "id": "t", "tokens": rows[1]["tokens"]}
    assert got[3]["embedding"] is None and got[3]["error"]
    for k in (1, 2):  # JSONL's short decimals read back as the same float32, bit for bit
        assert np.array_equal(np.array(got[k]["embedding"], np.float32),
                              np.array(rows[k]["embedding"], np.float32))


def test_dimensions_need_a_declared_size(random_model_dir: Path, tmp_path: Path,
                                         capsys) -> None:  # noqa: ANN001
    args = ["embed", "a", "--model", str(random_model_dir), "--dimensions", "8"]
    assert main(args) == EXIT_BAD_INPUT
    assert "declares no Matryoshka sizes" in capsys.readouterr().err
    assert main([*args, "--force-dimensions"]) == EXIT_OK
    assert len(lines(capsys.readouterr().out)[0]["embedding"]) == 8
    declared = tmp_path / "m"
    shutil.copytree(random_model_dir, declared)
    cfg = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**cfg, "matryoshka_dims": [8, 32]}))
    assert main(["embed", "a", "--model", str(declared), "--dimensions", "8"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert len(lines(out)[0]["embedding"]) == 8 and "declares no" not in err


def test_an_embedding_model_is_refused_by_run(random_model_dir: Path, tmp_path: Path,
                                              files: Path, capsys) -> None:  # noqa: ANN001
    declared = tmp_path / "emb"
    shutil.copytree(random_model_dir, declared)
    cfg = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**cfg,
                                                      "single_vector_pool_strategy": "mean"}))
    (files / "q.jsonl").write_text(json.dumps({"image": "a.png", "questions": ["Red?"]}) + "\n")
    assert main(["run", str(files / "q.jsonl"), "--model", str(declared)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "is an embedding model" in err and "vlmbatch embed" in err
    assert main(["submit", str(files / "q.jsonl"), "--job", str(tmp_path / "j"), "--pooling",
                 "last", "--model", str(random_model_dir)]) == EXIT_BAD_INPUT
    assert "add --task embed" in capsys.readouterr().err


def test_maxsim(random_model_dir: Path, files: Path, capsys) -> None:  # noqa: ANN001
    (files / "q.txt").write_text("a red circle\nis it blue?\n")
    assert main(["embed", "--maxsim", str(files / "q.txt"), str(files / "m.jsonl"), "--model",
                 str(random_model_dir)]) == EXIT_BAD_INPUT  # a doc cannot be read
    assert "missing.png" in capsys.readouterr().err
    docs = files / "d.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in [{"image": "a.png"},
                                                           {"text": "a red circle"}]))
    assert main(["embed", "--maxsim", str(files / "q.txt"), str(docs), "--document-prefix",
                 "Passage: ", "--model", str(random_model_dir)]) == EXIT_OK
    got = np.array([[float(x) for x in ln.split()] for ln in
                    capsys.readouterr().out.splitlines()])
    vlm = vlmbatch.VLM(random_model_dir)
    q = [e.vector for e in vlm.embed_many(["a red circle", "is it blue?"], multi_vector=True)]
    d = [e.vector for e in vlm.embed_many([(files / "a.png", None), "Passage: a red circle"],
                                          multi_vector=True)]
    assert got.shape == (2, 2) and np.abs(got - vlmbatch.maxsim(q, d)).max() <= 5e-5
    assert got[0, 1] < got[0, 0] or got[0, 1] > 0  # scores, not all equal
    assert np.isclose(vlmbatch.maxsim(q[0], q[0])[0, 0], len(q[0]), atol=1e-4)  # self: 1 each


def test_api_inputs_and_errors(random_model_dir: Path, files: Path) -> None:
    vlm = vlmbatch.VLM(random_model_dir)
    v = vlm.embed(texts=["x"], images=[str(files / "a.png"), files / "b.png"])
    assert v.shape == (3, 32) and v.dtype == np.float32
    out = list(vlm.embed_many([(files / "missing.png", None), "ok"]))
    assert out[0].vector is None and out[0].error_kind is not None
    tok = vlm.engine.model.tokenizer
    assert out[1].vector is not None and out[1].tokens == len(tok.encode("ok"))
    with pytest.raises(ValueError, match="could not be embedded"):
        vlm.embed(images=[files / "missing.png"])
    with pytest.raises(TypeError):
        vlm.embed(texts="not a list")  # type: ignore[arg-type]
