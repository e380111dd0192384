"""``POST /v1/embeddings``: OpenAI's request, validated here, answered by an
``EmbedBackend``.

The endpoint does not compute embeddings itself: it parses and checks the request, reads any
images (under the same media policy as chat), and hands the inputs to an ``EmbedBackend``,
a callable that returns one vector and one token count per input
(``serving/embed.py`` ``EngineEmbedBackend``: the drive loop's two stages, the model on an
engine thread). A server started with
``--no-embeddings`` answers a valid request 501; an invalid one is a 400 either way.

Accepted (OpenAI's contract, plus the two image forms other servers take):

- ``input``: a string, an array of strings, an array of token ids, or an array of arrays
  of token ids; at most ``MAX_INPUTS`` (2,048) inputs, ``MAX_INPUT_TOKENS`` (8,192) tokens
  each and ``MAX_REQUEST_TOKENS`` (300,000) in all. Token-id inputs are counted here;
  strings are counted by the backend (its engine owns the tokenizer), which refuses them with
  ``EmbedRefused`` (a 400) over the same limits, passed in ``EmbedOptions``.
- images as ``data:`` (or allowed ``file://``) URLs in ``input`` with ``"modality": "image"``
  (as Infinity does), or as chat-style ``messages``: their text parts and at most one image
  make one input, one embedding per request (as vLLM does); a ``video_url`` part is
  refused (a 400 naming it: clips are not embedded).
- ``encoding_format``: ``float`` (default) or ``base64``, little-endian float32 bytes (what
  the official clients ask for by default and decode); ``dimensions``: truncate (the
  backend re-normalises), at most its native size.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from vlmbatch.preprocessing.sources import SourceError, read_bytes
from vlmbatch.server.chat import ImagePart, Message, TextPart, require_model
from vlmbatch.server.chat_media import VideoPart
from vlmbatch.server.config import ServerConfig
from vlmbatch.server.errors import STRICT, bad_request, parsed
from vlmbatch.server.media import MediaRefused, check_image_url
from vlmbatch.serving.embed import (
    MAX_INPUT_TOKENS,
    MAX_INPUTS,
    MAX_REQUEST_TOKENS,
    EmbedBackend,
    EmbedInput,
    EmbedOptions,
)
from vlmbatch.serving.errors import APIError, EmbedRefused


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    model: str
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    modality: Literal["text", "image"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def parse_inputs(req: EmbeddingRequest, allowed: Path | None) -> list[EmbedInput]:
    """The request's inputs, checked (400s naming the parameter), images read."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("give either 'input' or 'messages'", "input",
                          "missing_required_parameter" if req.input is None else "invalid_value")
    if req.messages is not None:
        return [_from_messages(req.messages, allowed)]
    raw = req.input
    assert raw is not None
    single = isinstance(raw, str) or (bool(raw) and isinstance(raw[0], int))
    items: list = [raw] if single else list(raw)
    if not items:
        raise bad_request("'input' must not be empty", "input", "invalid_value")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"'input' has {len(items):,} items, over the limit of {MAX_INPUTS:,}",
                          "input", "invalid_value")
    if req.modality == "image":
        return [EmbedInput(image=_image(x, allowed, f"input[{i}]")) if isinstance(x, str)
                else _refuse_ids(i) for i, x in enumerate(items)]
    inputs = [_text_or_ids(x, i) for i, x in enumerate(items)]
    total = sum(len(x.token_ids) for x in inputs if x.token_ids is not None)
    if total > MAX_REQUEST_TOKENS:
        raise bad_request(f"the request has {total:,} tokens, over the limit of "
                          f"{MAX_REQUEST_TOKENS:,}", "input", "context_length_exceeded")
    return inputs


def _text_or_ids(x: str | list[int], i: int) -> EmbedInput:
    if isinstance(x, str):
        if not x:
            raise bad_request(f"input[{i}] is an empty string", f"input[{i}]", "invalid_value")
        return EmbedInput(text=x)
    if not x:
        raise bad_request(f"input[{i}] is an empty token array", f"input[{i}]", "invalid_value")
    if len(x) > MAX_INPUT_TOKENS:
        raise bad_request(f"input[{i}] has {len(x):,} tokens, over the limit of "
                          f"{MAX_INPUT_TOKENS:,}", f"input[{i}]", "context_length_exceeded")
    if min(x) < 0:
        raise bad_request(f"input[{i}] holds a negative token id", f"input[{i}]",
                          "invalid_value")
    return EmbedInput(token_ids=tuple(x))


def _refuse_ids(i: int) -> EmbedInput:
    raise bad_request(f"input[{i}]: with modality 'image' each input is an image URL",
                      f"input[{i}]", "invalid_value")


def _image(url: str, allowed: Path | None, param: str) -> bytes:
    try:
        data = read_bytes(check_image_url(url, allowed), Path("/"))
    except (MediaRefused, SourceError) as e:
        raise bad_request(f"{param}: {e}", param, "invalid_image_url") from None
    if not data:
        raise bad_request(f"{param}: the image is empty", param, "invalid_image")
    return data


def _from_messages(messages: list[Message], allowed: Path | None) -> EmbedInput:
    texts: list[str] = []
    images: list[bytes] = []
    for m, msg in enumerate(messages):
        parts = [TextPart(type="text", text=msg.content)] if isinstance(msg.content, str) \
            else (msg.content or [])
        for p, part in enumerate(parts):
            if isinstance(part, ImagePart):
                images.append(_image(part.image_url.url, allowed,
                                     f"messages[{m}].content[{p}].image_url.url"))
            elif isinstance(part, VideoPart):
                at = f"messages[{m}].content[{p}]"
                raise bad_request(f"{at}: a video_url part cannot be embedded (this server "
                                  "embeds text and still images); send frames as image_url "
                                  "parts in separate requests, or ask about the clip with "
                                  "/v1/chat/completions", at, "unsupported_media")
            elif part.text.strip():
                texts.append(part.text)
    if len(images) > 1:
        raise bad_request(f"messages hold {len(images)} images; one embedding per request "
                          "takes at most one", "messages", "invalid_value")
    if not texts and not images:
        raise bad_request("messages hold no text and no image to embed", "messages",
                          "invalid_value")
    return EmbedInput(text="\n".join(texts) or None, image=images[0] if images else None)


def embed(backend: EmbedBackend | None, req: EmbeddingRequest, inputs: list[EmbedInput],
          model: str) -> dict:
    """The ``list`` of embeddings for ``inputs``, or why not (400, or 501 with no
    backend)."""
    if backend is None:
        raise APIError(501, "embeddings are not available on this server: it was started "
                       "with --no-embeddings", None, "embeddings_unavailable")
    if req.dimensions is not None and req.dimensions > backend.dimensions:
        raise bad_request(f"dimensions {req.dimensions} is over the model's "
                          f"{backend.dimensions}", "dimensions", "invalid_value")
    try:
        out = backend(inputs, EmbedOptions(req.dimensions))
    except EmbedRefused as e:
        param = f"input[{e.index}]" if e.index is not None else "input"
        raise bad_request(str(e), param, e.code) from None
    vectors = np.asarray(out.vectors, dtype="<f4")
    want = req.dimensions or backend.dimensions
    if vectors.shape != (len(inputs), want) or len(out.tokens) != len(inputs):
        raise APIError(500, f"the embedding backend returned {vectors.shape} vectors and "
                       f"{len(out.tokens)} counts for {len(inputs)} inputs of {want}",
                       code="embedder_error")
    data = [{"object": "embedding", "index": i,
             "embedding": (base64.b64encode(v.tobytes()).decode()
                           if req.encoding_format == "base64" else v.tolist())}
            for i, v in enumerate(vectors)]
    n = int(sum(out.tokens))
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def embedding_routes(backend: EmbedBackend | None, cfg: ServerConfig) -> APIRouter:
    """``POST /v1/embeddings`` (the inputs read and the images' bytes fetched on a worker
    thread, the vectors from ``backend``; None: 501)."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        req = parsed(EmbeddingRequest, await request.body())
        require_model(req.model, cfg.served_model_name)
        inputs = await run_in_threadpool(parse_inputs, req, cfg.allowed_local_media_path)
        body = await run_in_threadpool(embed, backend, req, inputs,
                                       cfg.served_model_name)
        return JSONResponse(body)

    return router
