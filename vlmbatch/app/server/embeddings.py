"""``POST /v1/embeddings``: OpenAI's request, validated here, answered by an ``Embedder``.

The endpoint does not compute embeddings itself: it parses and checks the request, reads any
images (under the same media policy as chat), and hands the inputs to an ``Embedder``, a
callable that returns one vector and one token count per input (``EngineEmbedder`` below:
the drive loop's two stages, the model on the engine thread). A server started with
``--no-embeddings`` answers a valid request 501; an invalid one is a 400 either way.

Accepted (OpenAI's contract, plus the two image forms other servers take):

- ``input``: a string, an array of strings, an array of token ids, or an array of arrays
  of token ids; at most ``MAX_INPUTS`` (2,048) inputs, ``MAX_INPUT_TOKENS`` (8,192) tokens
  each and ``MAX_REQUEST_TOKENS`` (300,000) in all. Token-id inputs are counted here;
  strings are counted by the embedder (it owns the tokenizer), which refuses them with
  ``EmbedRefused`` (a 400) over the same limits, passed in ``EmbedOptions``.
- images as ``data:`` (or allowed ``file://``) URLs in ``input`` with ``"modality": "image"``
  (as Infinity does), or as chat-style ``messages``: their text parts and at most one image
  make one input, one embedding per request (as vLLM does).
- ``encoding_format``: ``float`` (default) or ``base64``, little-endian float32 bytes (what
  the official clients ask for by default and decode); ``dimensions``: truncate (the
  embedder re-normalises), at most its native size.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from vlmbatch.app.server.chat import STRICT, ImagePart, Message, TextPart, require_model
from vlmbatch.app.server.errors import APIError, bad_request, parsed
from vlmbatch.app.server.media import MediaRefused, check_image_url
from vlmbatch.engine.base import Engine
from vlmbatch.engine.config import ConfigError, EmbedConfig
from vlmbatch.pipeline.config import PrepareOptions
from vlmbatch.pipeline.drive import Preparer, prepared_groups, run_group
from vlmbatch.pipeline.records import Embedding, EmbedItem
from vlmbatch.pipeline.task import EmbedTask, Prepared
from vlmbatch.preprocessing.prepare import ImagePlan
from vlmbatch.preprocessing.sources import SourceError, read_bytes

if TYPE_CHECKING:
    from vlmbatch.app.server.engines import Engines
    from vlmbatch.app.server.serve import ServerState

MAX_INPUTS, MAX_INPUT_TOKENS, MAX_REQUEST_TOKENS = 2048, 8192, 300_000


@dataclass(frozen=True)
class EmbedInput:
    """One thing to embed: a text, token ids, an encoded image, or a text with an image."""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    image: bytes | None = None  # the file's bytes (PNG, JPEG...), read by the server


@dataclass(frozen=True)
class EmbedOptions:
    dimensions: int | None  # None: native size; else the first n, re-normalised
    max_input_tokens: int = MAX_INPUT_TOKENS
    max_request_tokens: int = MAX_REQUEST_TOKENS


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # [N, D] float32, row i for input i, unit length
    tokens: list[int]  # tokens read per input, special tokens included (``usage``)


class EmbedRefused(ValueError):
    """An input the embedder will not take (over a token limit, an undecodable image):
    answered 400. ``index``: which input, when one is to blame."""

    def __init__(self, message: str, index: int | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.index, self.code = index, code


class Embedder(Protocol):
    """What the endpoint calls: inputs in, one unit vector and one token count per input
    out, in order. Called from a request's worker thread: it must do its own locking (or
    hand the work to the engine thread)."""
    dimensions: int  # the native vector size

    def __call__(self, inputs: Sequence[EmbedInput], options: EmbedOptions) -> Embeddings: ...


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
            elif part.text.strip():
                texts.append(part.text)
    if len(images) > 1:
        raise bad_request(f"messages hold {len(images)} images; one embedding per request "
                          "takes at most one", "messages", "invalid_value")
    if not texts and not images:
        raise bad_request("messages hold no text and no image to embed", "messages",
                          "invalid_value")
    return EmbedInput(text="\n".join(texts) or None, image=images[0] if images else None)


def embed(embedder: Embedder | None, req: EmbeddingRequest, inputs: list[EmbedInput],
          model: str) -> dict:
    """The ``list`` of embeddings for ``inputs``, or why not (400, or 501 with no
    embedder)."""
    if embedder is None:
        raise APIError(501, "embeddings are not available on this server: it was started "
                       "with --no-embeddings", None, "embeddings_unavailable")
    if req.dimensions is not None and req.dimensions > embedder.dimensions:
        raise bad_request(f"dimensions {req.dimensions} is over the model's "
                          f"{embedder.dimensions}", "dimensions", "invalid_value")
    try:
        out = embedder(inputs, EmbedOptions(req.dimensions))
    except EmbedRefused as e:
        param = f"input[{e.index}]" if e.index is not None else "input"
        raise bad_request(str(e), param, e.code) from None
    vectors = np.asarray(out.vectors, dtype="<f4")
    want = req.dimensions or embedder.dimensions
    if vectors.shape != (len(inputs), want) or len(out.tokens) != len(inputs):
        raise APIError(500, f"the embedder returned {vectors.shape} vectors and "
                       f"{len(out.tokens)} counts for {len(inputs)} inputs of {want}",
                       code="embedder_error")
    data = [{"object": "embedding", "index": i,
             "embedding": (base64.b64encode(v.tobytes()).decode()
                           if req.encoding_format == "base64" else v.tolist())}
            for i, v in enumerate(vectors)]
    n = int(sum(out.tokens))
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def embed_dims(engine: Engine) -> int:
    """A pooled vector's full size on ``engine`` (the decoder's hidden size)."""
    return engine.embedding(EmbedConfig(multi_vector=False)).hidden


def embed_prepared(engine: Engine, dims: int | None, p: Prepared[EmbedItem]
                   ) -> list[list[Embedding]]:
    """On the engine thread: a prepared group's pooled vectors (``dims``: a Matryoshka size
    the checkpoint declares, else ``EmbedRefused``)."""
    cfg = EmbedConfig(dimensions=dims, multi_vector=False)
    try:
        engine.embedding(cfg)  # checked (and its head built) once per size
    except ConfigError as e:
        raise EmbedRefused(str(e), None) from None
    return run_group(EmbedTask(cfg), engine, p)


class EngineEmbedder:
    """The server's ``Embedder``: the inputs' images decoded on the request's thread (in the
    server's decoder processes), the vectors computed on an engine thread
    (``Engines.embed``: in an engine process, or this one)."""

    def __init__(self, engines: Engines, plan: ImagePlan, opts: PrepareOptions,
                 workers: Preparer | None) -> None:
        self.engines, self.plan, self.opts, self.workers = engines, plan, opts, workers
        assert engines.embed_dims is not None
        self.dimensions = engines.embed_dims

    def __call__(self, inputs: Sequence[EmbedInput], options: EmbedOptions) -> Embeddings:
        items = [_item(i, x) for i, x in enumerate(inputs)]
        task = EmbedTask(EmbedConfig(dimensions=options.dimensions, multi_vector=False))
        with closing(prepared_groups(task, [items], self.plan, self.opts,
                                     workers=self.workers)) as stage1:
            p = next(stage1)  # decoded here, on the request's thread
        # the engine reads each item's image from p.images, not its encoded bytes
        p.items = [dataclasses.replace(it, image=b"") if it.image is not None else it
                   for it in p.items]
        out = [e for per_item in self.engines.embed(options.dimensions, p).result()
               for e in per_item]
        total = 0
        for e in out:
            if e.vector is None:
                raise EmbedRefused(f"input {e.index} could not be embedded: {e.error}", e.index)
            tokens = e.tokens or 0
            if tokens > options.max_input_tokens:
                raise EmbedRefused(f"input {e.index} has {tokens:,} tokens, over the limit of "
                                   f"{options.max_input_tokens:,}", e.index,
                                   "context_length_exceeded")
            total += tokens
        if total > options.max_request_tokens:
            raise EmbedRefused(f"the request has {total:,} tokens, over the limit of "
                               f"{options.max_request_tokens:,}", None, "context_length_exceeded")
        vectors = np.stack([e.vector for e in out if e.vector is not None]).astype(np.float32)
        return Embeddings(vectors, [e.tokens or 0 for e in out])


def _item(i: int, x: EmbedInput) -> EmbedItem:
    if x.token_ids is not None:
        raise EmbedRefused("token-id inputs are not supported by this server: send the text",
                           i, "invalid_value")
    return EmbedItem(i, None, x.image, x.text, Path.cwd())


def embedding_routes(state: ServerState) -> APIRouter:
    """``POST /v1/embeddings`` (the inputs read and the images' bytes fetched on a worker
    thread, the vectors from the state's ``Embedder``)."""
    cfg = state.cfg
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        req = parsed(EmbeddingRequest, await request.body())
        require_model(req.model, cfg.served_model_name)
        inputs = await run_in_threadpool(parse_inputs, req, cfg.allowed_local_media_path)
        body = await run_in_threadpool(embed, state.embedder, req, inputs,
                                       cfg.served_model_name)
        return JSONResponse(body)

    return router
