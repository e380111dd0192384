"""The interactive endpoints: ``/health``, ``/v1/models``, ``/v1/embeddings`` on FastAPI's
router, and ``/v1/chat/completions`` as ``ChatEndpoint``, a plain ASGI app in front of it.

A chat request is validated by pydantic straight from the body's bytes
(``chat.ChatRequest``), turned into its one question (``chat.question_of``), its image taken
from the cache or prepared on a worker thread (``images.ImageCache``), queued for the engine
thread (``scheduler.Scheduler.submit``) and answered when its engine call is done; the event
loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from vlmbatch.app.server.chat import ChatRequest, completion, question_of, require_model
from vlmbatch.app.server.embeddings import EmbeddingRequest, embed, parse_inputs
from vlmbatch.app.server.errors import APIError, error_body, log, validation_error
from vlmbatch.app.server.state import ServerState

M = TypeVar("M", bound=BaseModel)
CHAT_PATH = "/v1/chat/completions"


def parsed(model: type[M], body: bytes) -> M:
    """``body`` parsed and validated as ``model`` (pydantic's JSON parser, in one pass), or
    the 400 naming the first problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def answer_chat(state: ServerState, body: bytes) -> dict:
    """The ``chat.completion`` for a request body, or the ``APIError`` it is answered with."""
    cfg = state.cfg
    with state.scheduler.arriving():
        req = parsed(ChatRequest, body)
        require_model(req.model, cfg.served_model_name)
        item = question_of(req, cfg.max_prompt_chars, cfg.max_completion_tokens)
        image = state.images.cached(item)
        if image is None:  # decode on a worker thread, not the event loop
            image = await run_in_threadpool(state.images.prepare, item)
        future = state.scheduler.submit(item, image)
    score = await asyncio.wrap_future(future)
    return completion(req, item, cfg.served_model_name, score, state.answer_words)


class ChatEndpoint:
    """``POST /v1/chat/completions`` as a plain ASGI app in front of FastAPI's router (inside
    the API key and body limit middlewares): the hot path, one request per question, skips
    the router's matching, dependency solving and exception layers, which took more of the
    event loop's time than the endpoint itself in a profile of bench/serve.py. Other methods
    on the path go on to FastAPI (a 404)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] == CHAT_PATH):
            await self.app(scope, receive, send)
            return
        try:
            body = await _body(receive)
            if body is None:
                return  # the client went away
            status, payload = 200, await answer_chat(self.state, body)
        except APIError as e:
            status, payload = e.status, error_body(e.status, e.message, e.param, e.code, e.type)
        except HTTPException as e:  # the body limit's 413
            status, payload = e.status_code, error_body(e.status_code, str(e.detail),
                                                        code="request_too_large")
        except Exception as e:  # noqa: BLE001  (a 500 in the error shape, logged)
            log.exception("unexpected error on POST %s", CHAT_PATH)
            status = 500
            payload = error_body(500, f"internal error: {type(e).__name__}",
                                 code="internal_error")
        data = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
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


def interactive_routes(state: ServerState) -> APIRouter:
    cfg = state.cfg
    router = APIRouter()
    started = int(time.time())
    model_card = {"id": cfg.served_model_name, "object": "model", "created": started,
                  "owned_by": "vlmbatch"}

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card]})

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        require_model(model, cfg.served_model_name)
        return JSONResponse(model_card)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        req = parsed(EmbeddingRequest, await request.body())
        require_model(req.model, cfg.served_model_name)
        inputs = await run_in_threadpool(parse_inputs, req, cfg.allowed_local_media_path)
        body = await run_in_threadpool(embed, state.embedder, req, inputs,
                                       cfg.served_model_name)
        return JSONResponse(body)

    return router
