"""The interactive endpoints: ``/health``, ``/v1/models``, ``/v1/chat/completions`` and
``/v1/embeddings``.

A chat request is parsed (FastAPI, ``chat.ChatRequest``), turned into its one question
(``chat.question_of``), its image prepared on a worker thread (``images.ImageCache``),
queued for the engine thread (``scheduler.Scheduler.submit``) and answered when its
engine call is done; the event loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from vlmbatch.server.chat import ChatRequest, completion, question_of, require_model
from vlmbatch.server.embeddings import EmbeddingRequest, embed, parse_inputs
from vlmbatch.server.state import ServerState


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
    async def chat(req: ChatRequest) -> JSONResponse:
        require_model(req.model, cfg.served_model_name)
        item = question_of(req, cfg.max_prompt_chars, cfg.max_completion_tokens)
        image = await run_in_threadpool(state.images.prepare, item)
        score = await asyncio.wrap_future(state.scheduler.submit(item, image))
        return JSONResponse(completion(req, item, cfg.served_model_name, score,
                                       state.answer_words))

    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> JSONResponse:
        require_model(req.model, cfg.served_model_name)
        inputs = await run_in_threadpool(parse_inputs, req, cfg.allowed_local_media_path)
        body = await run_in_threadpool(embed, state.embedder, req, inputs,
                                       cfg.served_model_name)
        return JSONResponse(body)

    return router
