"""OpenAI batch files of ``/v1/embeddings`` requests as embedding jobs
(``inputs/openai_embeddings.py``):
every bad line named, one job item per request whatever its input's length, vectors equal
``VLM.embed``, a repeated ``custom_id`` refused at submit."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import vlmbatch
from tests.inputs.test_fuzz_readers import fuzz
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.inputs.openai_embeddings import EmbedRequestItem, iter_embed_requests
from vlmbatch.jobs.folder import STORE_FILE
from vlmbatch.jobs.store import JobStore
from vlmbatch.jobs.tasks import limited
from vlmbatch.outputs.lines import to_embed_output
from vlmbatch.pipeline.questions import ManifestError
from vlmbatch.pipeline.records import Embedding, ErrorKind


def line(cid: object, body: dict, url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"


def body(inp: object, **extra: object) -> dict:
    return {"model": "vlmbatch", "input": inp, **extra}


def test_every_bad_line_is_named(tmp_path: Path) -> None:
    bad = [  # (line, what its message must say)
        (line("c", body("hi"), url="/v1/chat/completions"), "does not match"),
        (json.dumps({"method": "POST", "url": "/v1/embeddings", "body": body("x")}) + "\n",
         "custom_id"),
        (line("t", body([1, 2, 3])), "token-id"),
        (line("tt", body([[1, 2], [3]])), "token-id"),
        (line("n", body(7)), "body.input must be"),
        (line("e", body(["ok", ""])), "body.input[1]"),
        (line("m", body(["ok", 3])), "body.input[1]"),
        (line("f", body("x", encoding_format="hex")), "encoding_format"),
        (line("d", body("x", dimensions=0)), "dimensions"),
        (line("u", {**body("x"), "modality": "image"}), "unknown key"),
        (line(None, body("x")), "custom_id"),
        ("not json\n", "not valid JSON"),
    ]
    good = line("ok", body(["a", "b"], dimensions=64, encoding_format="base64"))
    path = tmp_path / "in.jsonl"
    path.write_text(good + "".join(text for text, _ in bad))
    errors: list[tuple[int, str]] = []
    reqs = list(iter_embed_requests(path, lambda n, msg: errors.append((n, msg))))
    assert reqs == [(1, EmbedRequestItem("ok", ("a", "b"), 64, "base64"))]
    assert [n for n, _ in errors] == list(range(2, len(bad) + 2))
    for (_, msg), (_, want) in zip(errors, bad):
        assert want in msg, (want, msg)
    with pytest.raises(ManifestError, match=r"in\.jsonl:2: url '/v1/chat/completions'"):
        list(iter_embed_requests(path))


def test_a_request_is_one_item_and_its_vectors_equal_vlm_embed(tmp_path: Path) -> None:
    reqs = [("z", "a red circle", {}),
            ("a", ["a blue square", "two green triangles", "a shape"], {}),
            ("m", ["a red circle"], {"dimensions": 64})]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line(cid, body(inp, **extra)) for cid, inp, extra in reqs))
    job = tmp_path / "job"
    assert main(["submit", str(path), "--task", "embed", "--job", str(job), "--model",
                 str(vlmbatch.EMBED_MODEL), "--images-per-batch", "2", "--no-progress"]) \
        == EXIT_OK
    assert main(["run", str(job), "--no-progress"]) == EXIT_OK
    store = JobStore(job / STORE_FILE)
    try:
        assert store.counts().done == len(reqs)  # items are requests, not strings
    finally:
        store.close()
    out = tmp_path / "out.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK  # OpenAI output lines
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    vlm = vlmbatch.VLM(vlmbatch.EMBED_MODEL)
    for (cid, inp, extra), got in zip(reqs, lines, strict=True):
        texts = [inp] if isinstance(inp, str) else inp
        assert got["custom_id"] == cid and got["error"] is None
        data = got["response"]["body"]["data"]
        assert [d["index"] for d in data] == list(range(len(texts)))
        v = np.array([d["embedding"] for d in data], np.float32)
        assert np.abs(v - vlm.embed(texts=texts, **extra)).max() <= 1e-5
        tokens = sum(e.tokens or 0 for e in vlm.embed_many(texts))
        assert got["response"]["body"]["usage"]["prompt_tokens"] == tokens
    assert main(["results", str(job), "-o", str(tmp_path / "v.npy")]) == EXIT_OK
    assert np.load(tmp_path / "v.npy").shape[0] == 5  # a row per string, at full size


def test_a_repeated_custom_id_is_refused_at_submit(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    path = tmp_path / "in.jsonl"
    path.write_text(line("same", body("x")) + line("other", body("y")) + line("same", body("z")))
    assert main(["submit", str(path), "--task", "embed", "--job", str(tmp_path / "job"),
                 "--model", str(vlmbatch.EMBED_MODEL), "--no-progress"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "in.jsonl:3" in err and "'same' appears twice (first on line 1)" in err


def test_submit_checks_what_a_server_batch_checks(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A request's dimensions must be one of the model's declared sizes (named by line), and
    options that would change what an OpenAI line holds are refused, before any work."""
    path = tmp_path / "in.jsonl"
    path.write_text(line("a", body("x", dimensions=64)) + line("b", body("y", dimensions=63)))
    base = ["submit", str(path), "--task", "embed", "--job", str(tmp_path / "job"), "--model",
            str(vlmbatch.EMBED_MODEL), "--no-progress"]
    assert main(base) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "in.jsonl:2: body.dimensions 63" in err and "declares the sizes" in err
    path.write_text(line("a", body("x", dimensions=64)))
    for option in (["--multi-vector"], ["--dimensions", "64"]):
        assert main(base + option) == EXIT_BAD_INPUT, option
        assert "do not apply" in capsys.readouterr().err
    assert not (tmp_path / "job").exists()
    assert main(base) == EXIT_OK


def test_a_multi_vector_checkpoint_answers_requests_with_pooled_vectors(
        tmp_path: Path) -> None:
    """A ColQwen2 checkpoint is multi-vector by default; a request still gets one vector per
    string, equal to its pooled embedding (``--no-multi-vector``)."""
    from tests.models.qwen_vl_helpers import save_colqwen2_checkpoint

    col = save_colqwen2_checkpoint("qwen2_5_vl", tmp_path / "col")
    path = tmp_path / "in.jsonl"
    path.write_text(line("a", body(["a red circle", "a blue square"])))
    job = tmp_path / "job"
    assert main(["submit", str(path), "--task", "embed", "--job", str(job), "--model", str(col),
                 "--no-progress"]) == EXIT_OK
    assert main(["run", str(job), "--no-progress"]) == EXIT_OK
    out = tmp_path / "out.jsonl"
    assert main(["results", str(job), "-o", str(out)]) == EXIT_OK
    (got,) = [json.loads(x) for x in out.read_text().splitlines()]
    v = np.array([d["embedding"] for d in got["response"]["body"]["data"]], np.float32)
    want = list(vlmbatch.VLM(col).embed_many(["a red circle", "a blue square"],
                                             multi_vector=False))
    assert v.shape == (2, want[0].vector.shape[0])
    assert np.abs(v - np.stack([e.vector for e in want])).max() <= 1e-5


def test_a_request_with_a_failed_input_is_an_error_line() -> None:
    item = EmbedRequestItem("r", ("a", "b"))
    ok = Embedding(0, "r", 3, np.ones(4, np.float32) / 2)
    bad = Embedding(1, "r", None, None, "engine failed: RuntimeError: boom", ErrorKind.ENGINE)
    out = to_embed_output(item, [ok, bad], "vlmbatch")
    assert out["response"] is None and out["custom_id"] == "r"
    assert out["error"]["code"] == "engine_error" and "input 1" in out["error"]["message"]
    assert "boom" in out["error"]["message"]
    fine = to_embed_output(item, [ok, dataclasses.replace(ok, index=1)], "vlmbatch")
    assert fine["error"] is None and fine["response"]["body"]["usage"]["prompt_tokens"] == 6


@pytest.mark.slow  # a Ray instance (~25 s on 2 cores)
def test_on_ray_the_lines_equal_the_in_process_run(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(line("z", body("a red circle")) + line("a", body(["a blue square", "two"]))
                    + line("m", body("a shape", dimensions=64, encoding_format="base64")))
    out = {}
    for executor in ("local", "ray"):
        job = tmp_path / executor
        assert main(["submit", str(path), "--task", "embed", "--job", str(job), "--model",
                     str(vlmbatch.EMBED_MODEL), "--images-per-batch", "2",
                     "--no-progress"]) == EXIT_OK
        assert main(["run", str(job), "--executor", executor, "--no-progress"]) == EXIT_OK
        out[executor] = tmp_path / f"{executor}.jsonl"
        assert main(["results", str(job), "-o", str(out[executor])]) == EXIT_OK
    assert out["ray"].read_text() == out["local"].read_text()
    assert [json.loads(x)["custom_id"] for x in out["ray"].read_text().splitlines()] == \
        ["z", "a", "m"]


def test_the_token_limits_of_v1_embeddings_fail_a_request() -> None:
    def results(tokens: list[int]) -> list[Embedding]:
        return [Embedding(i, "r", t, np.ones(4, np.float32) / 2) for i, t in enumerate(tokens)]

    ok = results([10, 8192, 5])
    assert limited(ok) == ok
    out = limited(results([10, 8193, 9000]))  # the first one over 8,192 per input
    assert [e.error is None for e in out] == [True, False, True]
    assert out[1].error_kind == ErrorKind.TOO_LARGE and "8,193 tokens" in str(out[1].error)
    many = limited(results([8000] * 40))  # 300,000 per request: crossed at input 37
    assert [k for k, e in enumerate(many) if e.error] == [37]
    line = to_embed_output(EmbedRequestItem("r", ("x",) * 40), many, "vlmbatch")
    assert line["error"]["code"] == "too_large_error" and "input 37" in line["error"]["message"]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
KEYS = [("custom_id",), ("method",), ("url",), ("body",), ("body", "model"), ("body", "input"),
        ("body", "encoding_format"), ("body", "dimensions"), ("body", "extra")]


@fuzz(600)
@given(key=st.sampled_from(KEYS), value=JSON | st.lists(st.integers(), max_size=3)
       | st.lists(st.text(max_size=5), max_size=3), drop=st.booleans())
def test_any_value_at_any_key_is_a_request_or_its_line_named(tmp_path_factory, key: tuple,
                                                             value: Any, drop: bool) -> None:  # noqa: ANN001
    """A valid line with one value replaced (or deleted): accepted with every field as a job
    needs it, or refused through ``on_error`` naming line 1; never another exception."""
    rec: dict = {"custom_id": "r", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "m", "input": ["a", "b"]}}
    where = rec["body"] if len(key) == 2 else rec
    if drop:
        where.pop(key[-1], None)
    else:
        where[key[-1]] = value
    path = tmp_path_factory.mktemp("f") / "in.jsonl"
    path.write_text(json.dumps(rec) + "\n", encoding="utf-8", errors="surrogatepass")
    errors: list[tuple[int, str]] = []
    reqs = [r for _, r in iter_embed_requests(path, lambda n, m: errors.append((n, m)))]
    OUTCOMES[bool(reqs)] += 1
    assert len(reqs) + len(errors) == 1 and all(n == 1 and m for n, m in errors)
    for r in reqs:
        assert r.custom_id.strip() and r.texts and all(t.strip() for t in r.texts)
        "".join((r.custom_id, *r.texts)).encode("utf-8")
        assert r.encoding_format in ("float", "base64")
        assert r.dimensions is None or (type(r.dimensions) is int and r.dimensions >= 1)


OUTCOMES: Counter = Counter()


def test_the_fuzzing_saw_both_outcomes() -> None:
    if not OUTCOMES:
        pytest.skip("run with the fuzz test")
    assert OUTCOMES[True] and OUTCOMES[False], OUTCOMES
