"""OpenAI Batch API input and output."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from vlmbatch.cli.commands import EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main
from vlmbatch.inputs.manifest import manifest_format, read_manifest
from vlmbatch.pipeline.media_inputs import MAX_IMAGES, ImageList, SamplingKeys, VideoInput
from vlmbatch.pipeline.questions import ManifestError, Question


def request(cid: str, url: str, text: str = "Is there a red shape?") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "max_tokens": 1, "messages": [
                {"role": "system", "content": "You answer yes or no."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": text}]}]}}


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture()
def png_url(tmp_path: Path) -> str:
    ok, buf = cv2.imencode(".png", np.full((40, 60, 3), 200, np.uint8))
    (tmp_path / "a.png").write_bytes(buf.tobytes())
    return "data:image/png;base64," + base64.b64encode(buf.tobytes()).decode()


def test_parse_requests(tmp_path: Path, png_url: str) -> None:
    m = write(tmp_path / "b.jsonl", [request("r1", png_url),
                                     request("r2", f"file://{tmp_path}/a.png", "Circle?")])
    assert manifest_format(m) == "openai"
    a, b = read_manifest(m)
    assert (a.id, a.image, a.questions) == ("r1", png_url,
                                            (Question("q0", "Is there a red shape?"),))
    assert b.questions[0].text == "Circle?"


@pytest.mark.parametrize("bad,msg", [
    ({"custom_id": "x", "body": {"messages": []}}, "non-empty"),
    ({**request("x", "a.png"), "url": "/v1/embeddings"}, "not supported"),
    (request("x", "a.png", text=""), "no text"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "no image"}]}},
     "needs an image_url or a video_url part"),
])
def test_bad_requests_name_the_line(tmp_path: Path, bad: dict, msg: str) -> None:
    m = write(tmp_path / "b.jsonl", [request("ok", "a.png"), bad])
    with pytest.raises(ManifestError, match=rf"b\.jsonl:2: .*{msg}"):
        read_manifest(m)


def test_several_images_and_a_clip_per_line(tmp_path: Path) -> None:
    """Several ``image_url`` parts are one item (an ``ImageList``, in order); a ``video_url``
    part a clip sampled by ``mm_processor_kwargs`` (``inputs/chat_media.py``); the
    limits and bad keys name the line."""
    def line(cid: str, *media: tuple[str, str], **extra: object) -> dict:
        r = request(cid, "x.png")
        r["body"]["messages"][1]["content"] = [{"type": k, k: {"url": u}} for k, u in media] \
            + [{"type": "text", "text": "Red?"}]
        r["body"].update(extra)
        return r

    m = write(tmp_path / "b.jsonl", [
        line("pair", ("image_url", "b.png"), ("image_url", "a.png")),
        line("clip", ("video_url", "c.mkv"), mm_processor_kwargs={"fps": 2, "max_frames": 8}),
        line("bare", ("video_url", "c.mkv"))])
    pair, clip, bare = read_manifest(m)
    assert pair.image == ImageList(("b.png", "a.png"))
    assert clip.image == VideoInput("c.mkv", SamplingKeys(2.0, None, 8))
    assert bare.image == VideoInput("c.mkv", SamplingKeys())
    for bad, msg in [
            (line("x", *[("image_url", "a.png")] * (MAX_IMAGES + 1)), f"limit of {MAX_IMAGES}"),
            (line("x", ("video_url", "c.mkv"), ("video_url", "d.mkv")), "at most 1 clip"),
            (line("x", ("video_url", "c.mkv"), ("image_url", "a.png")), "not both"),
            (line("x", ("video_url", "c.mkv"), mm_processor_kwargs={"num_frames": 0}),
             "num_frames must be a whole number >= 1"),
            (line("x", ("image_url", "a.png"), mm_processor_kwargs={"fps": 1}),
             "needs a video_url part")]:
        with pytest.raises(ManifestError, match=rf"b\.jsonl:1: .*{msg}"):
            read_manifest(write(tmp_path / "b.jsonl", [bad]))


def test_structured_output_choices(tmp_path: Path, png_url: str) -> None:
    """vLLM's ``structured_outputs: {"choice": [...]}`` and ``guided_choice`` ask a label
    set; another structured output, two different lists or a malformed list name the line."""
    def with_body(cid: str, **extra: object) -> dict:
        r = request(cid, png_url, "Which colour?")
        r["body"].update(extra)
        return r

    m = write(tmp_path / "b.jsonl", [
        with_body("a", structured_outputs={"choice": ["red", "blue"]}),
        with_body("b", guided_choice=["red", "blue"]),
        with_body("c", guided_choice=["x", "y"], structured_outputs={"choice": ["x", "y"]}),
        with_body("d")])
    assert [it.questions[0].choices for it in read_manifest(m)] == [
        ("red", "blue"), ("red", "blue"), ("x", "y"), ()]
    for extra, msg in [({"structured_outputs": {"regex": "a+"}}, "supports only"),
                       ({"guided_choice": ["a", "b"], "structured_outputs": {"choice": ["a"]}},
                        "differ"),
                       ({"guided_choice": ["a"]}, "guided_choice: choices must list at least 2")]:
        bad = write(tmp_path / "bad.jsonl", [with_body("a"), with_body("b", **extra)])
        with pytest.raises(ManifestError, match=rf"bad\.jsonl:2: .*{msg}"):
            read_manifest(bad)


def test_max_tokens_above_one_asks_for_a_text_answer(tmp_path: Path, png_url: str,
                                                      random_model_dir: Path) -> None:
    """max_tokens 1 (yes/no clients) keeps the thresholded answer; more asks for a text
    answer of up to that many tokens, as an OpenAI-compatible server gives."""
    long = request("r2", png_url)
    long["body"]["max_tokens"] = 5
    newer = request("r3", png_url)
    del newer["body"]["max_tokens"]
    newer["body"]["max_completion_tokens"] = 3
    m = write(tmp_path / "b.jsonl", [request("r1", png_url), long, newer])
    assert [it.questions[0].max_new_tokens for it in read_manifest(m)] == [None, 5, 3]
    plain = write(tmp_path / "p.jsonl", [request(c, png_url) for c in ("r1", "r2", "r3")])

    def contents(manifest: Path, *extra: str) -> list[str]:
        out = tmp_path / "o.jsonl"
        assert main(["run", str(manifest), "-o", str(out), "--model", str(random_model_dir),
                     "--no-progress", *extra]) == 0
        return [json.loads(x)["response"]["body"]["choices"][0]["message"]["content"]
                for x in out.read_text().splitlines()]

    got = contents(m)
    assert got[0] in ("yes", "no") and got[1:] != ["yes", "no"]
    # r2 and r3 answer as max_tokens 1 requests do under --max-new-tokens 5 and 3
    assert (got[1], got[2]) == (contents(plain, "--max-new-tokens", "5")[1],
                                contents(plain, "--max-new-tokens", "3")[2])
    bad = request("r4", png_url)
    bad["body"]["max_tokens"] = 0
    with pytest.raises(ManifestError, match=r"b2\.jsonl:1: body\.max_tokens must be"):
        read_manifest(write(tmp_path / "b2.jsonl", [bad]))


def test_policy_and_mixing_are_refused(tmp_path: Path) -> None:
    m = write(tmp_path / "b.jsonl", [request("r", "a.png")])
    with pytest.raises(ManifestError, match="policy does not apply"):
        read_manifest(m, (Question("p0", "?"),))
    mixed = write(tmp_path / "c.jsonl", [request("r", "a.png"),
                                         {"id": "v", "image": "a.png", "questions": ["q"]}])
    with pytest.raises(ManifestError, match="mixes"):
        read_manifest(mixed)


def test_run_writes_openai_output(tmp_path: Path, png_url: str, random_model_dir: Path) -> None:
    m = write(tmp_path / "b.jsonl", [request("r1", png_url), request("r2", "a.png", "Circle?"),
                                     request("r3", "https://example.com/x.png")])
    out = tmp_path / "out.jsonl"
    rc = main(["run", str(m), "--model", str(random_model_dir), "-o", str(out),
               "--no-progress"])
    assert rc == EXIT_ITEM_ERRORS
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"r1", "r2", "r3"}
    for cid in ("r1", "r2"):
        body = rows[cid]["response"]["body"]
        assert rows[cid]["error"] is None and rows[cid]["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] in ("yes", "no")
        assert 0 <= body["vlmbatch"]["p_yes"] <= 1
    assert rows["r3"]["response"] is None and "https" in rows["r3"]["error"]["message"]
    # the same job through submit/results gives the same lines
    job = tmp_path / "job"
    main(["submit", str(m), "--job", str(job), "--model", str(random_model_dir), "--wait",
          "--no-progress"])
    again = tmp_path / "again.jsonl"
    main(["results", str(job), "-o", str(again)])
    assert again.read_text() == out.read_text()
