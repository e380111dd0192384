"""The FastAPI app of ``vlmbatch serve``: its routers, the middlewares that run before any
endpoint, error shapes, and ``/health``, ``/metrics`` and ``/v1/models``.

``create_app(state)`` is all a test or an embedding program needs (``serve.serve`` adds the
engines, the data folder's lock and uvicorn). Plain ASGI layers, outermost first: the
request metrics (``metrics.RequestMetrics``: every answer counted, 401s included), the API
key (nothing is read for a caller without it), the body limit, then the chat endpoint
(``chat.ChatEndpoint``: POST /v1/chat/completions served there, the hot path), and behind
them the FastAPI app of the other routes, whose error handlers (``errors.install``) give
every other error OpenAI's shape.

``ApiKey``: with a key set, every path but ``/health`` needs ``Authorization: Bearer KEY``;
the comparison is ``hmac.compare_digest`` on bytes (constant time whatever the guess).
``BodyLimit``: a declared ``Content-Length`` over the limit is refused at once (413); a
chunked body is counted as it is read, and the read that crosses the limit raises a 413
``HTTPException``, which FastAPI passes through its body parsing to the error handlers.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmbatch.server import errors
from vlmbatch.server.batches import batch_routes
from vlmbatch.server.chat import ChatEndpoint, require_model
from vlmbatch.server.embeddings import embedding_routes
from vlmbatch.server.errors import error_body
from vlmbatch.server.files import file_routes
from vlmbatch.server.metrics import Metrics, RequestMetrics
from vlmbatch.server.state import ServerState

OPEN_PATHS = {"/health"}


def create_app(state: ServerState) -> ASGIApp:
    """The server's ASGI app: the request metrics, the API key, the body limit and the chat
    endpoint, in that order, in front of the FastAPI app of every other route (so a chat
    request, the hot path, never enters FastAPI's own layers)."""
    app = fastapi_app(state)
    chat = ChatEndpoint(app, state.chat)  # POST /v1/chat/completions
    limited = BodyLimit(chat, state.cfg.max_body_bytes)
    return RequestMetrics(ApiKey(limited, state.cfg.api_key), state.metrics)  # outermost


def fastapi_app(state: ServerState) -> FastAPI:
    """Every route but chat completions, with the error handlers and the lifespan."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await run_in_threadpool(state.stop)  # after uvicorn has drained in-flight requests

    app = FastAPI(title="vlmbatch", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    errors.install(app)
    for router in (info_routes(state.cfg.served_model_name, state.metrics),
                   embedding_routes(state.embeddings, state.cfg), file_routes(state.files),
                   batch_routes(state.book, state.files, state.worker, state.cancel_batch,
                                state.embeddings is not None)):
        app.include_router(router)
    return app


def info_routes(served_model_name: str, metrics_page: Metrics) -> APIRouter:
    """``/health`` (no key needed), ``/metrics``, ``/v1/models``, ``/v1/models/{id}``."""
    router = APIRouter()
    started = int(time.time())
    model_card = {"id": served_model_name, "object": "model", "created": started,
                  "owned_by": "vlmbatch"}

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    def metrics() -> Response:  # a worker thread: the batches' records are read from disk
        data, kind = metrics_page.page()
        return Response(data, media_type=kind)

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card]})

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        require_model(model, served_model_name)
        return JSONResponse(model_card)

    return router


async def _send_error(send: Send, status: int, message: str, code: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class ApiKey:
    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.expected is None
                or scope["path"] in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            what = "no API key given" if not given else "incorrect API key"
            await _send_error(send, 401, f"{what}: send 'Authorization: Bearer KEY' with the "
                              "server's --api-key", "invalid_api_key",
                              [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    def _message(self) -> str:
        return (f"request body over the server's limit of {self.limit:,} bytes "
                "(--max-body-mib)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > self.limit:
                    await _send_error(send, 413 if declared > 0 else 400,
                                      self._message() if declared > 0 else
                                      "invalid Content-Length header", "request_too_large"
                                      if declared > 0 else "invalid_header")
                    return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)
