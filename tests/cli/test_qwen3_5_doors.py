"""Qwen3.5 (a hybrid decoder) through every door that takes a label set or gives embeddings:
the manifest and the policy (``vlmbatch run``), the Python API, OpenAI batch lines
(``structured_outputs.choice`` / ``guided_choice``), the server's chat completions and
``/v1/embeddings``, and ``vlmbatch embed --model``. Each door gives what ``vlmbatch.VLM``
gives; the numbers themselves are checked against transformers in
``tests/engine/test_hybrid_choices.py`` (label sets) and
``tests/engine/test_embed_reference_qwen.py`` (embeddings, Qwen3.5 included). The tiny
random Qwen3.5 of ``tests/models/qwen_vl_helpers.py``."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

import vlmbatch
from tests.api.test_vlm import same_line
from tests.models.qwen_vl_helpers import save_engine_checkpoint
from tests.server.serving import IMAGES, Server, chat_body, data_url
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.inputs.manifest import read_manifest, read_policy

ROOT = Path(__file__).resolve().parents[2]
MANIFEST, POLICY = ROOT / "examples" / "labels.jsonl", ROOT / "examples" / "labels.yaml"
SHAPES = ["circle", "rectangle", "triangle"]
QUESTION = "What is the shape?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_engine_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def vlm(model_dir: Path) -> vlmbatch.VLM:
    return vlmbatch.VLM(model_dir)


def test_manifest_policy_and_api(model_dir: Path, vlm: vlmbatch.VLM, tmp_path: Path) -> None:
    """The label-set example (a line's own label set, a policy's label sets behind its
    system turn, a yes/no question with an instruction): ``run``'s lines = ``ask_many``'s."""
    out = tmp_path / "r.jsonl"
    assert main(["run", str(MANIFEST), "--policy", str(POLICY), "--model", str(model_dir),
                 "-o", str(out), "--no-progress"]) == EXIT_OK
    want = [json.loads(x) for x in out.read_text().splitlines()]
    got = [a.line() for a in vlm.ask_many(read_manifest(MANIFEST, read_policy(POLICY)))]
    assert len(got) == len(want) == 13 and all(w["error"] is None for w in want)
    assert all(same_line(a, b) for a, b in zip(got, want)), (got, want)
    labelled = [w for w in want if w.get("probs")]
    assert len(labelled) == 9 and all(w["answer"] in w["probs"] for w in labelled)


def test_openai_batch_lines(model_dir: Path, vlm: vlmbatch.VLM, tmp_path: Path) -> None:
    """Batch lines asking a label set both ways: the content is ``ask``'s label, the
    ``vlmbatch`` extension its probs."""
    image = IMAGES / "scene_01.png"
    (want,) = vlm.ask([image], [{"id": "s", "text": QUESTION, "choices": SHAPES}])
    lines = []
    for cid, extra in (("a", {"structured_outputs": {"choice": SHAPES}}),
                       ("b", {"guided_choice": SHAPES})):
        lines.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                      "body": chat_body(image.as_uri(), QUESTION, max_tokens=1, **extra)})
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    assert main(["run", str(batch), "--model", str(model_dir), "-o", str(out),
                 "--no-progress"]) == EXIT_OK
    for row in map(json.loads, out.read_text().splitlines()):
        body = row["response"]["body"]
        assert body["choices"][0]["message"]["content"] == want.label
        assert body["vlmbatch"]["probs"] == pytest.approx(want.probs, abs=1e-5)


def test_embed_cli(model_dir: Path, vlm: vlmbatch.VLM, tmp_path: Path,
                   capsys: pytest.CaptureFixture) -> None:
    texts = ["a red circle", "a blue square"]
    capsys.readouterr()
    assert main(["embed", *texts, "--model", str(model_dir)]) == EXIT_OK
    got = np.array([json.loads(x)["embedding"] for x in capsys.readouterr().out.splitlines()
                    if x.strip()], np.float32)
    npy = tmp_path / "v.npy"
    pngs = [IMAGES / "scene_00.png", IMAGES / "scene_02.png"]
    assert main(["embed", "--images", *map(str, pngs), "-o", str(npy), "--model",
                 str(model_dir)]) == EXIT_OK
    assert np.abs(got - vlm.embed(texts=texts)).max() == 0
    assert np.abs(np.load(npy) - vlm.embed(images=pngs)).max() == 0


def test_server_label_sets_and_embeddings(model_dir: Path, vlm: vlmbatch.VLM,
                                          tmp_path: Path) -> None:
    """``vlmbatch serve --model`` a Qwen3.5: chat completions with a label set
    (``structured_outputs.choice``, ``guided_choice``) answer as ``ask``; ``/v1/embeddings``
    (texts, an image, base64) as ``embed``."""
    image = IMAGES / "scene_01.png"
    (want,) = vlm.ask([image], [{"id": "s", "text": QUESTION, "choices": SHAPES}])
    texts = ["a red circle", "two blue squares"]
    vectors = np.concatenate([vlm.embed(texts=texts), vlm.embed(images=[image])])
    server = Server(tmp_path / "data", "--model", str(model_dir),
                    "--allowed-local-media-path", str(IMAGES)).wait_ready()
    try:
        with server.client() as c:
            for extra in ({"structured_outputs": {"choice": SHAPES}}, {"guided_choice": SHAPES}):
                r = c.post("/v1/chat/completions",
                           json=chat_body(data_url(image), QUESTION, **extra))
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["choices"][0]["message"]["content"] == want.label
                assert body["vlmbatch"]["probs"] == pytest.approx(want.probs, abs=1e-5)
            r = c.post("/v1/embeddings", json={"model": "vlmbatch", "input": texts,
                                               "encoding_format": "float"})
            assert r.status_code == 200, r.text
            got = [d["embedding"] for d in r.json()["data"]]
            r = c.post("/v1/embeddings", json={"model": "vlmbatch", "modality": "image",
                                               "input": [data_url(image)],
                                               "encoding_format": "base64"})
            assert r.status_code == 200, r.text
            got.append(np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]),
                                     "<f4").tolist())
        assert np.abs(np.array(got, np.float32) - vectors).max() <= 1e-5
    finally:
        assert server.stop() in (0, 143), server.output()


def test_quantize_is_refused_with_why(model_dir: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    """W4A16 calibration groups attention and MLP linears; a Gated DeltaNet layer has
    neither, so ``vlmbatch quantize`` refuses the model before any work, saying so."""
    assert main(["quantize", "--model", str(model_dir), "--method", "awq", "--calib",
                 str(ROOT / "examples" / "manifest.jsonl"), "--policy",
                 str(ROOT / "examples" / "policy.yaml"), "--out", str(tmp_path / "q"),
                 "--no-progress"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "qwen3_5" in err and "linear-attention" in err and not (tmp_path / "q").exists()
