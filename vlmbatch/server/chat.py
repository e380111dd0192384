"""``POST /v1/chat/completions``: the request as pydantic parses it, the question it asks,
the ``chat.completion`` it is answered with, and the endpoint itself (``ChatEndpoint``: a
plain ASGI app in front of FastAPI's router).

A chat request is validated by pydantic straight from the body's bytes (``ChatRequest``),
turned into its one question (``question_of``), its image taken from the media cache or
prepared on a worker thread (``media_cache.MediaCache``: in a decoder process), and the
``Question`` handed
to the engines (``serving.engines.Engines.submit``) and answered when its engine call is
done (``Chat``); the event loop never blocks on the model.

A request is read exactly as a line of an OpenAI batch file is (``inputs.openai_batch``):
one ``image_url`` part (several: one prompt holding them in order; or one ``video_url``
part sampled by ``mm_processor_kwargs``: ``chat_media.py``), its text parts joined as the
question, ``max_completion_tokens``
(else ``max_tokens``) above 1 asking for a text answer of up to that many tokens, 1 or
absent for the thresholded yes/no. So an interactive answer equals the batch line for the
same request.

A label set: vLLM's ``structured_outputs: {"choice": [...]}`` (or ``guided_choice``, its
older name) makes the question a label set (``Question.choices``); the content is the most
probable choice, the ``vlmbatch`` field carries ``label``, ``probs`` and ``logprobs`` (each
choice's whole-sequence log-likelihood: ``inputs.openai_batch.vlmbatch_fields``), and
``logprobs: true`` gives the choices' log-probabilities normalised over the label set (the
answer's entry, its ``top_logprobs`` the choices most likely first). A label set the engine
cannot score as configured (``--choice-scoring first-token`` and two choices starting with
the same token) is a 400 naming them.

``logprobs``: the first token's, over the two answer classes (the yes words and the no
words, ``--yes``/``--no``), renormalised: ``exp(logprob("yes")) == p_yes``, which is what a
standard client computes from ``top_logprobs``. They are not the full vocabulary's
(``top_logprobs`` above 2 gives the same two entries).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.loading import label_set_checker, text_tokens
from vlmbatch.engine.records import Item, Score
from vlmbatch.inputs.openai_batch import parse_request
from vlmbatch.outputs.lines import vlmbatch_fields
from vlmbatch.pipeline.media_inputs import ImageList, VideoInput
from vlmbatch.pipeline.questions import ManifestError, PromptLimits, PromptTooLong, Question
from vlmbatch.pipeline.records import Answer, ImageItem
from vlmbatch.preprocessing.prepare import PreparedImage
from vlmbatch.server.chat_media import VideoPart, prepare_media
from vlmbatch.server.config import ServerConfig
from vlmbatch.server.errors import STRICT, bad_request, error_body, log, parsed
from vlmbatch.server.media_cache import MediaCache
from vlmbatch.serving.engines import Engines
from vlmbatch.serving.errors import APIError

CHAT_PATH = "/v1/chat/completions"
ROOT_DIR = Path("/")  # base folder of a request's image: unused (bare paths are refused)


class ImageURL(BaseModel):
    model_config = STRICT
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = STRICT
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """What is read; sampling options (temperature, top_p, seed...) are accepted and
    ignored: answers are greedy."""
    model_config = STRICT
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    user: str | None = None
    # a label set (vLLM's names; inputs.openai_batch reads them from the body)
    structured_outputs: dict[str, Any] | None = None
    guided_choice: list[str] | None = None
    # a clip's sampling (vLLM's name; inputs.chat_media reads fps, num_frames, max_frames)
    mm_processor_kwargs: dict[str, Any] | None = None


def question_of(req: ChatRequest, max_prompt_chars: int, max_tokens: int) -> ImageItem:
    """The one (image URL, question) the request asks, as a batch line's item, or a 400."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true",
                          "stream_options", "invalid_value")
    if req.n not in (None, 1):
        raise bad_request("n must be 1: answers are greedy, so every choice would be the same",
                          "n", "unsupported_parameter")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    asked = req.max_completion_tokens or req.max_tokens or 1
    if asked > max_tokens:
        raise bad_request(f"max_tokens {asked} is over this server's limit of {max_tokens} "
                          "(--max-completion-tokens)", "max_tokens", "invalid_value")
    body = req.model_dump(exclude_none=True)
    try:
        # base folder unused: bare paths are refused (media.check_image_url) before reading
        item = parse_request({"custom_id": "request", "body": body}, "request", ROOT_DIR)
    except ManifestError as e:
        raise bad_request(str(e).removeprefix("request: ").replace("body.", ""),
                          getattr(e, "param", "messages"), "invalid_value") from None
    if (n := item.questions[0].prompt_chars) > max_prompt_chars:  # as a batch line's check
        raise bad_request(f"the question is {n:,} characters, over this server's limit of "
                          f"{max_prompt_chars:,} (--max-prompt-chars)", "messages",
                          "context_length_exceeded")
    return item


def _logp(margin: float) -> tuple[float, float]:
    """(log P(yes), log P(no)) from the logit margin, without rounding:
    ``p_yes = sigmoid(margin)``, so ``log p_yes = -log(1 + e^-margin)``."""
    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))

    return log_sigmoid(margin), log_sigmoid(-margin)


def logprobs_of(margin: float, top: int, words: tuple[str, str], yes: bool
                ) -> dict[str, Any]:
    """``choices[0].logprobs``: the first token's entry (the class answered: yes when
    ``yes``) and its ``top_logprobs`` (``top`` of the two classes, most likely first)."""
    entries: dict[str, dict[str, Any]] = {
        w: {"token": w, "logprob": max(v, -9999.0), "bytes": list(w.encode())}  # OpenAI's floor
        for w, v in zip(words, _logp(margin))}
    ranked = sorted(entries.values(), key=lambda e: -e["logprob"])
    return {"content": [{**entries[words[0] if yes else words[1]],
                         "top_logprobs": ranked[:top]}], "refusal": None}


def label_logprobs(a: Answer, top: int) -> dict[str, Any]:
    """``choices[0].logprobs`` of a label-set answer: the answer's entry, log of its
    probability normalised over the choices, and ``top`` of the choices most likely first."""
    assert a.probs is not None and a.label is not None
    entries: dict[str, dict[str, Any]] = {
        c: {"token": c, "logprob": max(math.log(p), -9999.0) if p > 0 else -9999.0,
            "bytes": list(c.encode())} for c, p in a.probs.items()}  # OpenAI's floor
    ranked = sorted(entries.values(), key=lambda e: -e["logprob"])
    return {"content": [{**entries[a.label], "top_logprobs": ranked[:top]}], "refusal": None}


def completion(req: ChatRequest, item: ImageItem, model: str, s: Score,
               words: tuple[str, str], prepared: Item | None = None) -> dict:
    """The ``chat.completion`` for ``item``'s score ``s``, with ``vlmbatch: {p_yes, margin,
    image_tokens}`` (a label set's: also ``label``, ``probs``, ``logprobs``; a clip's
    ``prepared`` item: also ``frames`` and ``seconds``, what the model saw)."""
    a = Answer.scored(item.id, item.questions[0], s).seen(prepared)  # as a job's line
    text = a.text if a.text is not None else a.answer
    if not req.logprobs:
        lp = None
    elif a.choices:
        lp = label_logprobs(a, req.top_logprobs or 0)
    else:
        lp = logprobs_of(s.margin, req.top_logprobs or 0, words,
                         a.answer == "yes")
    prompt = s.prompt_tokens or 0
    out = 1 if a.text is None else (s.completion_tokens or 0)  # yes/no: its one token
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": lp}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                  "total_tokens": prompt + out},
        "vlmbatch": vlmbatch_fields(a)}


def require_model(name: str, served: str, param: str = "model") -> None:
    if name != served:
        raise APIError(404, f"the model {name!r} does not exist: this server serves "
                       f"{served!r} (GET /v1/models)", param, "model_not_found")


def stream_events(req: ChatRequest, done: dict) -> bytes:
    """A ``chat.completion`` as the server-sent events of ``stream: true``: the answer in
    one ``chat.completion.chunk`` (role, content, logprobs and finish_reason: a yes/no is
    one token, and a text answer comes whole from the engine), then with
    ``stream_options.include_usage`` a chunk of ``usage`` and no choices, then ``[DONE]``."""
    usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {k: done[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"
    c = done["choices"][0]
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                         "content": c["message"]["content"]},
                                  "logprobs": c["logprobs"],
                                  "finish_reason": c["finish_reason"]}],
             "vlmbatch": done["vlmbatch"]}
    chunks = [first]
    if usage:
        first["usage"] = None
        chunks.append({**head, "choices": [], "usage": done["usage"]})
    return b"".join(b"data: " + json.dumps(x, ensure_ascii=False, allow_nan=False).encode()
                    + b"\n\n" for x in chunks) + b"data: [DONE]\n\n"


class Chat:
    """What ``/v1/chat/completions`` answers with: the server's limits and model name, the
    chat images (``media_cache.MediaCache``) and the engines (``serving.engines.Engines``)."""

    def __init__(self, cfg: ServerConfig, engines: Engines, images: MediaCache) -> None:
        self.cfg, self.engines, self.images = cfg, engines, images
        # how logprobs name the two classes
        self.words = (cfg.engine.yes_words[0], cfg.engine.no_words[0])
        self._choices: Callable[[tuple[str, ...]], None] | None = None
        self._limits: PromptLimits | None = None  # made on the first request
        # data: images being decoded, by content hash (their bytes, the decode): the event
        # loop's own, so requests that wait for one hop to no thread
        self._decoding: dict[bytes, tuple[bytes, asyncio.Future[PreparedImage]]] = {}

    def check_context(self, q: Question) -> None:
        """A 400 ``context_length_exceeded`` for a question longer than the model's context
        in tokens (as a batch line's check; the tokenizer is read on the first request)."""
        if self._limits is None:
            count, context = text_tokens(self.cfg.model.path)
            self._limits = PromptLimits(self.cfg.max_prompt_chars, context, count)
        try:
            self._limits.check(q, "request")
        except PromptTooLong as e:
            raise bad_request(str(e).removeprefix("request: "), "messages",
                              "context_length_exceeded") from None

    def check_choices(self, choices: tuple[str, ...]) -> None:
        """A 400 for a label set the engines would not score (checked here, before its
        image is decoded: the engines may be other processes); the tokenizer is read on the
        first label set."""
        if self._choices is None:
            self._choices = label_set_checker(self.cfg.model.path, self.cfg.engine)
        try:
            self._choices(choices)
        except ConfigError as e:
            raise bad_request(str(e), "structured_outputs", "invalid_value") from None

    async def answer(self, body: bytes) -> tuple[ChatRequest, dict]:
        """The request and its ``chat.completion``, or the ``APIError`` it is answered
        with."""
        cfg = self.cfg
        with self.engines.arriving():
            req = parsed(ChatRequest, body)
            require_model(req.model, cfg.served_model_name)
            item = question_of(req, cfg.max_prompt_chars, cfg.max_completion_tokens)
            self.check_context(item.questions[0])
            if choices := item.questions[0].choices:
                self.check_choices(choices)
            media = item.image
            assert isinstance(media, (str, ImageList, VideoInput))  # parse_request's kinds
            image: Item = await (self.image(media) if isinstance(media, str) else
                                 prepare_media(media, self.image, self.images,
                                               self.engines.video_plan))
            future = self.engines.ask(item.questions[0], image)
        score = await future
        return req, completion(req, item, cfg.served_model_name, score, self.words, image)


    async def image(self, url: str) -> PreparedImage:
        """The request's image, prepared: a ``data:`` URL read and looked up here, a hit
        answered at once, a miss decoded on a worker thread (not the event loop), once for
        every request that asks meanwhile (they wait for it here, on the loop); a file or an
        http(s) image read on a worker thread too."""
        images = self.images
        if not images.reads_inline(url):
            def read_and_prepare() -> PreparedImage:
                source, data = images.read(url)
                return images.prepare(data, source)

            return await run_in_threadpool(read_and_prepare)
        source, data = images.read(url)
        hit = images.get(data)
        if hit is not None:
            return hit
        key = images.hash(data)
        flight = self._decoding.get(key)
        if flight is not None and flight[0] == data:
            images.joined()
            return await asyncio.shield(flight[1])
        task = asyncio.ensure_future(run_in_threadpool(images.prepare, data, source))
        if flight is None:  # a different image with the same hash decodes alone
            self._decoding[key] = (data, task)
            task.add_done_callback(lambda _: self._decoding.pop(key, None))
        return await asyncio.shield(task)


class ChatEndpoint:
    """``POST /v1/chat/completions`` as a plain ASGI app in front of the FastAPI app (inside
    the API key and body limit layers): the hot path, one request per question, skips
    FastAPI's middleware stack, router, dependency solving and exception layers, which took
    more of the event loop's time than the endpoint itself in a profile of bench/serve.py.
    Other methods on the path go on to FastAPI (a 404)."""

    def __init__(self, app: ASGIApp, chat: Chat) -> None:
        self.app, self.chat = app, chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] == CHAT_PATH):
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = []
        try:
            body = await _body(receive)
            if body is None:
                return  # the client went away
            req, payload = await self.chat.answer(body)
            status = 200
            if req.stream:
                await _send(send, 200, stream_events(req, payload), b"text/event-stream",
                            [(b"cache-control", b"no-cache")])
                return
        except APIError as e:
            status, payload = e.status, error_body(e.status, e.message, e.param, e.code, e.type)
            headers = [(k.lower().encode(), v.encode()) for k, v in e.headers().items()]
        except HTTPException as e:  # the body limit's 413
            status, payload = e.status_code, error_body(e.status_code, str(e.detail),
                                                        code="request_too_large")
        except Exception as e:  # noqa: BLE001  (a 500 in the error shape, logged)
            log.exception("unexpected error on POST %s", CHAT_PATH)
            status = 500
            payload = error_body(500, f"internal error: {type(e).__name__}",
                                 code="internal_error")
        data = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
        await _send(send, status, data, b"application/json", headers)


async def _send(send: Send, status: int, data: bytes, kind: bytes,
                headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


async def _body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
