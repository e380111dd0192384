"""The FastAPI app of ``vlmbatch serve``: routes, error shapes, API key and body limit.

``create_app(state)`` is all a test or an embedding program needs (``serve`` in
``run.py`` adds the engine, the data folder's lock and uvicorn). Middlewares, outermost
first: the API key (nothing is read for a caller without it), the body limit, then the chat
endpoint (``routes.ChatEndpoint``: POST /v1/chat/completions served in front of the
router); the error handlers (``errors.install``) give every other error OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from vlmbatch.app.server import errors
from vlmbatch.app.server.batch_routes import batch_routes, file_routes
from vlmbatch.app.server.middleware import ApiKey, BodyLimit
from vlmbatch.app.server.routes import ChatEndpoint, interactive_routes
from vlmbatch.app.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await run_in_threadpool(state.stop)  # after uvicorn has drained in-flight requests

    app = FastAPI(title="vlmbatch", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    errors.install(app)
    for router in (interactive_routes(state), file_routes(state), batch_routes(state)):
        app.include_router(router)
    app.add_middleware(ChatEndpoint, state=state)  # POST /v1/chat/completions, the hot path
    app.add_middleware(BodyLimit, limit=state.cfg.max_body_bytes)
    app.add_middleware(ApiKey, key=state.cfg.api_key)  # added last: the outermost
    return app
