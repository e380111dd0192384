"""``vlmbatch serve``: an OpenAI-compatible server over the same engine and job store. This
package is its HTTP side (FastAPI, pydantic, uvicorn); the engine side, which imports none
of them, is ``vlmbatch/serving/`` (engine processes, the engine thread, the channel).

    config.py          ``ServerConfig`` (the serve command's config root) and its options
    serve.py           ``serve()``: the data folder's lock, the engines, uvicorn
    state.py           ``ServerState``: what a running server holds (resuming unfinished
                       batches), handed to the routes piece by piece
    app.py             the FastAPI app: routers, the metrics, API key and body-limit
                       middlewares, /health, /metrics, /v1/models
    errors.py          every error in OpenAI's shape; request bodies parsed (``parsed``)
    chat.py            /v1/chat/completions: a request -> its one question -> the engines
                       -> chat.completion (or its ``stream: true`` events)
    chat_media.py      a chat request's several images or clip prepared into one item
    embeddings.py      /v1/embeddings: requests validated, handed to the embedding backend
    media.py           which image URLs may be read (the media policy)
    media_cache.py     a chat image paid for once: kept prepared by the content hash of
                       its bytes, decoded once however many ask at once
    metrics.py         GET /metrics (prometheus_client): requests, queues, tokens, batches
    files.py           /v1/files: files on disk (list, expiry, delete), routes
    batches.py         /v1/batches: batch records on disk, routes
    batch_worker.py    validates new batches into jobs, writes finished batches' files,
                       moves records on as their jobs end (``BookEvents``)
    ray_batches.py     ``--executor ray``: each batch a job driven on the Ray executor

``docs/server.md`` has the design; ``cli/serve_command.py`` ``cmd_serve`` starts it.
"""

from vlmbatch.server.config import ServerConfig

__all__ = ["ServerConfig"]
