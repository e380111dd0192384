"""Every way in decodes the same way (the one drive loop, ``pipeline/drive.py``): an image whose
decoder hangs or crashes is that item's ``decode_timeout`` / ``decoder_crashed`` error and
the rest go on. ``run``, jobs in-process and on Ray have their own tests
(``tests/jobs/test_decoder_faults.py``, ``test_ray_executor.py``); here the paths that
decoded on threads with no deadline until the drive loop was one: the Python API (``ask``,
``embed_many``), ``vlmbatch embed``, ``vlmbatch eval``, and the server (interactive chat and
embeddings, and a batch)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import cv2
import easy_vqa
import numpy as np
import pytest

from tests.faults import hooks_from
from tests.server.serving import Server, batch_lines, chat_body, data_url, wait_batch
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.pipeline.records import ErrorKind


def images(folder: Path, names: str = "abc") -> list[Path]:
    rng = np.random.default_rng(3)
    out = []
    for n in names:
        p = folder / f"{n}.png"
        cv2.imwrite(str(p), rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
        out.append(p)
    return out


def test_the_api_fails_a_hung_image_only(tmp_path: Path, random_model_dir: Path) -> None:
    import vlmbatch

    paths = images(tmp_path)
    with vlmbatch.VLM(random_model_dir, decode_timeout=2,
                      hooks=hooks_from({"hang_on": "b.png"})) as vlm:
        start = time.monotonic()
        answers = list(vlm.ask([str(p) for p in paths], ["Red?", "A circle?"]))
        assert time.monotonic() - start < 60
    kinds = [a.error_kind for a in answers]
    assert kinds == [None, None, ErrorKind.DECODE_TIMEOUT, ErrorKind.DECODE_TIMEOUT, None, None]
    assert "b.png: decoding timed out after 2s" in (answers[2].error or "")


def test_the_api_embeds_around_a_crashing_decoder(tmp_path: Path,
                                                  random_model_dir: Path) -> None:
    import vlmbatch

    paths = images(tmp_path)
    with vlmbatch.VLM(random_model_dir, hooks=hooks_from({"crash_on": "c.png"})) as vlm:
        out = list(vlm.embed_many([(str(p), None) for p in paths] + ["a text"]))
        again = list(vlm.ask([str(paths[0])], ["Red?"]))  # the same VLM goes on
    assert [e.error_kind for e in out] == [None, None, ErrorKind.DECODER_CRASHED, None]
    assert all(e.vector is not None for e in (out[0], out[1], out[3]))
    assert again[0].error is None


def test_embed_cli_fails_a_hung_image_only(tmp_path: Path, random_model_dir: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    paths = images(tmp_path)
    rc = main(["embed", "--model", str(random_model_dir), "--decode-timeout", "2",
               "--images", *map(str, paths)], hooks=hooks_from({"hang_on": "a.png"}))
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == EXIT_ITEM_ERRORS
    assert [x.get("error") is None for x in lines] == [False, True, True]
    assert "decoding timed out" in lines[0]["error"]


def test_eval_goes_on_past_a_crashing_decoder(capsys: pytest.CaptureFixture) -> None:
    """The built-in model on easy-vqa's first test questions: the image whose decoder
    crashes loses its questions (they count as wrong), the others are answered as always."""
    first = Path(easy_vqa.get_test_image_paths()[0]).name  # the first question's image
    argv = ["eval", "--limit", "40", "--no-progress"]
    assert main(argv) == EXIT_OK
    clean = capsys.readouterr().out
    assert main(argv, hooks=hooks_from({"crash_on": "/" + first})) == EXIT_OK
    hurt = capsys.readouterr().out

    def correct(text: str) -> int:
        return int(text.split("(")[1].split("/")[0])

    assert "(" in clean and correct(hurt) < correct(clean)


def test_the_server_answers_around_a_hung_decoder(tmp_path: Path,
                                                  random_model_dir: Path) -> None:
    """Interactive chat and embeddings: the hung image's request is a 400 naming the
    timeout, the server goes on; a batch: that line's error, the others answered. (A chat
    image reaches its decoder as its URL, an embedding input's as bytes: the fault hangs on
    either.)"""
    a, b = images(tmp_path, "ab")
    srv = Server(tmp_path / "data", "--model", str(random_model_dir), "--decode-timeout", "2",
                 "--embed-model", str(random_model_dir), faults={"hang_on": "hang|<bytes>"})
    hung = data_url(b).replace("data:image/png;base64,", "data:image/png;hang=1;base64,")
    try:
        srv.wait_ready()
        with srv.client() as http:
            r = http.post("/v1/chat/completions", json=chat_body(hung, "Red?"))
            assert r.status_code == 400 and r.json()["error"]["code"] == "decode_timeout"
            ok = http.post("/v1/chat/completions", json=chat_body(data_url(a), "Red?"))
            assert ok.status_code == 200
            e = http.post("/v1/embeddings", json={"model": "vlmbatch", "modality": "image",
                                                  "input": [hung]})
            assert e.status_code == 400 and "decoding timed out" in e.json()["error"]["message"]
        client = srv.openai()
        f = client.files.create(file=("in.jsonl", batch_lines(
            [("ok", data_url(a), "Red?"), ("bad", hung, "Red?")]).encode()), purpose="batch")
        batch = wait_batch(client, client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id,
        timeout=120)
        assert batch.status == "completed", batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
        err = client.files.content(batch.error_file_id).text
        assert '"custom_id": "bad"' in err and "decoding timed out" in err
    finally:
        srv.stop()
