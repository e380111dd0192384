"""Several images and a clip per request through ``vlmbatch serve`` (issue 44's server
door: ``inputs/chat_media.py``, ``server/chat_media.py``), on the session's shared server
(``conftest.py``: the built-in InternVL model, ``--allowed-local-media-path`` = ``media``,
where the clip and images are written here) through the official ``openai`` client.

The reference for an answer is the Python API on the same files and settings
(``vlmbatch.VLM.ask`` with a list of images or ``vlmbatch.video(...)``, whose answers equal
``vlmbatch run``'s and ``Engine.score``'s: ``tests/cli/test_video_doors.py``); the frames a
response says the model saw are computed here by hand from transformers' InternVL rule
(one frame from the middle of each of n equal segments: ``docs/video.md``), not read from
the code under test. Clips are made here, lossless (``tests/preprocessing/video_clips.py``).
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import httpx
import openai
import pytest

import vlmbatch
from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from tests.server.serving import (
    IMAGES,
    Server,
    create_batch,
    data_url,
    wait_batch,
)
from vlmbatch.inputs.chat_media import MAX_CLIPS, MAX_PARTS
from vlmbatch.pipeline.media_inputs import MAX_IMAGES

Q = "Is there a red shape?"


@pytest.fixture(scope="module")
def clips(media: Path) -> Path:
    """The shared server's media folder with a 20-frame clip (25 fps: 0.8 s), two images
    and a text file named ``.mkv``."""
    (media / "clip.mkv").write_bytes(make_clip(frames(20, 64, 48), FFV1_MKV))
    (media / "junk.mkv").write_text("not a clip at all")
    return media


@pytest.fixture(scope="module")
def vlm() -> vlmbatch.VLM:
    return vlmbatch.VLM()


def clip_url(path: Path) -> str:
    return "data:video/x-matroska;base64," + base64.b64encode(path.read_bytes()).decode()


def parts(*media: tuple[str, str]) -> list[dict]:
    """A user message's content: the media parts (kind, url) in order, then the question."""
    return [{"type": k, k: {"url": u}} for k, u in media] + [{"type": "text", "text": Q}]


def body(*media: tuple[str, str], **extra: object) -> dict:
    return {"model": "vlmbatch", "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": parts(*media)}], **extra}


def p_yes(r: openai.types.chat.ChatCompletion) -> float:
    """P(yes) as a client reads it: exp of the yes entry's log-probability (unrounded)."""
    top = {t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}
    return math.exp(top["yes"])


def margin(r: openai.types.chat.ChatCompletion) -> float:
    """The logit margin, unrounded: log P(yes) - log P(no) of the two entries."""
    top = {t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}
    return top["yes"] - top["no"]


def ask(client: openai.OpenAI, *media: tuple[str, str], **extra: object):  # noqa: ANN201
    b = body(*media)
    return client.chat.completions.create(
        model=b["model"], max_tokens=1, logprobs=True, top_logprobs=2,
        messages=b["messages"], extra_body=extra or None)


def segment_middles(total: int, n: int) -> list[int]:
    """transformers' InternVL rule, by hand: frame int(total/n * (k + 1/2)) for k < n."""
    return [int(total / n * (k + 0.5)) for k in range(n)]


@pytest.mark.parametrize("how", ["data", "file"])
def test_a_clip_is_answered_as_the_api_answers_it(client: openai.OpenAI, clips: Path,
                                                  vlm: vlmbatch.VLM, how: str) -> None:
    path = clips / "clip.mkv"
    url = clip_url(path) if how == "data" else path.as_uri()
    r = ask(client, ("video_url", url), mm_processor_kwargs={"num_frames": 4})
    (want,) = vlm.ask([vlmbatch.video(path, num_frames=4)], [Q])
    assert want.p_yes is not None and want.seconds is not None
    assert p_yes(r) == pytest.approx(want.p_yes, abs=2e-6)  # want: rounded to 1e-6
    assert margin(r) == pytest.approx(want.margin, abs=1e-4)  # want: rounded to 1e-4
    assert r.choices[0].message.content == want.answer
    seen = r.model_extra["vlmbatch"]
    idx = segment_middles(20, 4)
    assert idx == [2, 7, 12, 17]
    assert seen["frames"] == 4 and seen["seconds"] == [i / 25 for i in idx]
    assert seen["seconds"] == list(want.seconds)
    assert seen["image_tokens"] == want.image_tokens


def test_sampling_settings_reach_the_frames(client: openai.OpenAI, clips: Path,
                                            vlm: vlmbatch.VLM) -> None:
    url = clip_url(clips / "clip.mkv")
    # fps 10 of a 25 fps clip of 20 frames: int(20 / 25 * 10) = 8 segments
    r = ask(client, ("video_url", url), mm_processor_kwargs={"fps": 10})
    assert r.model_extra["vlmbatch"]["seconds"] == [i / 25 for i in segment_middles(20, 8)]
    (want,) = vlm.ask([vlmbatch.video(clips / "clip.mkv", fps=10)], [Q])
    assert want.p_yes is not None
    assert p_yes(r) == pytest.approx(want.p_yes, abs=2e-6)
    assert margin(r) == pytest.approx(want.margin, abs=1e-4)
    r = ask(client, ("video_url", url), mm_processor_kwargs={"num_frames": 2})
    assert r.model_extra["vlmbatch"]["seconds"] == [i / 25 for i in segment_middles(20, 2)]
    r = ask(client, ("video_url", url))  # none given: the checkpoint's 8 (InternVL's card)
    assert r.model_extra["vlmbatch"]["seconds"] == [i / 25 for i in segment_middles(20, 8)]


def test_two_images_are_one_prompt_in_order(client: openai.OpenAI, vlm: vlmbatch.VLM
                                            ) -> None:
    a, b = IMAGES / "scene_01.png", IMAGES / "scene_02.png"
    ab = ask(client, ("image_url", data_url(a)), ("image_url", data_url(b)))
    ba = ask(client, ("image_url", data_url(b)), ("image_url", data_url(a)))
    (want,) = vlm.ask([[a, b]], [Q])
    assert want.p_yes is not None
    assert p_yes(ab) == pytest.approx(want.p_yes, abs=2e-6)
    assert margin(ab) == pytest.approx(want.margin, abs=1e-4)
    assert "frames" not in ab.model_extra["vlmbatch"]
    assert ab.model_extra["vlmbatch"]["image_tokens"] == want.image_tokens
    # the order reaches the model: the swapped pair is another prompt
    assert abs(ab.model_extra["vlmbatch"]["margin"] - ba.model_extra["vlmbatch"]["margin"]) \
        > 1e-4


def test_a_batch_line_takes_a_clip_and_images(client: openai.OpenAI, clips: Path,
                                              vlm: vlmbatch.VLM) -> None:
    a, b = IMAGES / "scene_01.png", IMAGES / "scene_02.png"
    lines = {
        "clip": body(("video_url", clip_url(clips / "clip.mkv")),
                     mm_processor_kwargs={"num_frames": 4}),
        "pair": body(("image_url", data_url(a)), ("image_url", data_url(b))),
        "junk": body(("video_url", "data:video/mp4;base64,"
                      + base64.b64encode(b"not a clip").decode())),
    }
    text = "".join(json.dumps({"custom_id": k, "method": "POST", "url": "/v1/chat/completions",
                               "body": v}) + "\n" for k, v in lines.items())
    done = wait_batch(client, create_batch(client, text).id)
    assert done.status == "completed", done.errors
    out = {x["custom_id"]: x for x in map(
        json.loads, client.files.content(done.output_file_id).text.splitlines())}
    err = {x["custom_id"]: x for x in map(
        json.loads, client.files.content(done.error_file_id).text.splitlines())}
    clip = out["clip"]["response"]["body"]["vlmbatch"]
    (want,) = vlm.ask([vlmbatch.video(clips / "clip.mkv", num_frames=4)], [Q])
    assert clip["p_yes"] == pytest.approx(want.p_yes, abs=2e-6)
    assert clip["frames"] == 4 and clip["seconds"] == [i / 25 for i in segment_middles(20, 4)]
    (pair,) = vlm.ask([[a, b]], [Q])
    assert out["pair"]["response"]["body"]["vlmbatch"]["p_yes"] == pytest.approx(pair.p_yes,
                                                                                 abs=2e-6)
    assert "frames" not in out["pair"]["response"]["body"]["vlmbatch"]
    assert err["junk"]["error"]["code"] == "decode_error", err["junk"]


TINY = "data:image/png;base64,AAAA"  # refused before any bytes are read


@pytest.mark.parametrize(("request_body", "param", "says"), [
    (body(*[("image_url", TINY)] * (MAX_IMAGES + 1)), "messages",
     f"{MAX_IMAGES + 1} image_url parts, over the limit of {MAX_IMAGES}"),
    ({**body(("image_url", TINY)), "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * (MAX_PARTS + 1)}]}, "messages",
     f"over the limit of {MAX_PARTS} per request"),
    (body(("video_url", TINY), ("video_url", TINY)), "messages",
     f"at most {MAX_CLIPS} clip"),
    (body(("video_url", TINY), ("image_url", TINY)), "messages", "not both"),
    (body(("video_url", TINY), mm_processor_kwargs={"fps": 0}), "mm_processor_kwargs",
     "fps must be a number > 0"),
    (body(("video_url", TINY), mm_processor_kwargs={"fps": 2, "num_frames": 4}),
     "mm_processor_kwargs", "give fps or num_frames, not both"),
    (body(("video_url", TINY), mm_processor_kwargs={"max_frames": 1.5}),
     "mm_processor_kwargs", "max_frames must be a whole number"),
    (body(("video_url", TINY), mm_processor_kwargs={"frames": 4}), "mm_processor_kwargs",
     "unknown key(s) 'frames'"),
    (body(("image_url", TINY), mm_processor_kwargs={"fps": 1}), "mm_processor_kwargs",
     "needs a video_url part"),
    (body(("video_url", "file:///etc/passwd")), "messages",
     "video_url part: file:// URL outside --allowed-local-media-path"),
])
def test_refusals_name_the_field_and_the_limit(server: Server, request_body: dict,
                                               param: str, says: str) -> None:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=request_body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_bad_clip_bytes_are_a_400_and_the_server_goes_on(server: Server, clips: Path) -> None:
    with server.client() as c:
        for url, says in ((clip_url(clips / "junk.mkv"), "not a readable video"),
                          ((clips / "junk.mkv").as_uri(), "not a readable video"),
                          (clip_url(clips / "clip.mkv"), "fewer than the 40 asked")):
            extra = {"mm_processor_kwargs": {"num_frames": 40}} if "40" in says else {}
            r = c.post("/v1/chat/completions", json=body(("video_url", url), **extra))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["message"].startswith("video_url part: the clip could not be "
                                               "decoded"), error
            assert says in error["message"] and error["code"] == "invalid_video", error
        r = c.post("/v1/chat/completions", json=body(("image_url", data_url(
            IMAGES / "scene_01.png"))))
        assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_embeddings_refuse_a_clip(server: Server, clips: Path) -> None:
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"model": "vlmbatch", "messages": [
            {"role": "user", "content": parts(("video_url", clip_url(clips / "clip.mkv")))}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[0]"
    assert "video_url part cannot be embedded" in error["message"]
