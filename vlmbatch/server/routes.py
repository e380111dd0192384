"""The interactive endpoints: ``/health``, ``/v1/models``, ``/v1/chat/completions`` and
``/v1/embeddings``.

A chat request is parsed (``chat.ChatRequest``, validated from the body's bytes by pydantic
in one pass, the hot path skipping FastAPI's own body handling), turned into its one
question (``chat.question_of``), its image taken from the cache or prepared on a worker
thread (``images.ImageCache``), queued for the engine thread
(``scheduler.Scheduler.submit``) and answered when its engine call is done; the event loop
never blocks on the model.
"""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from vlmbatch.server.chat import ChatRequest, completion, question_of, require_model
from vlmbatch.server.embeddings import EmbeddingRequest, embed, parse_inputs
from vlmbatch.server.errors import validation_error
from vlmbatch.server.state import ServerState

M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], body: bytes) -> M:
    """``body`` parsed and validated as ``model`` (pydantic's JSON parser, in one pass), or
    the 400 naming the first problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


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

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        req = parsed(ChatRequest, await request.body())
        require_model(req.model, cfg.served_model_name)
        item = question_of(req, cfg.max_prompt_chars, cfg.max_completion_tokens)
        image = state.images.cached(item)
        if image is None:  # decode on a worker thread, not the event loop
            image = await run_in_threadpool(state.images.prepare, item)
        score = await asyncio.wrap_future(state.scheduler.submit(item, image))
        return JSONResponse(completion(req, item, cfg.served_model_name, score,
                                       state.answer_words))

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        req = parsed(EmbeddingRequest, await request.body())
        require_model(req.model, cfg.served_model_name)
        inputs = await run_in_threadpool(parse_inputs, req, cfg.allowed_local_media_path)
        body = await run_in_threadpool(embed, state.embedder, req, inputs,
                                       cfg.served_model_name)
        return JSONResponse(body)

    return router
