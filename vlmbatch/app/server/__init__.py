"""``vlmbatch serve``: an OpenAI-compatible server over the same engine and job store, one
file per concern.

    config.py          ``ServerConfig`` (the serve command's config root) and its options
    serve.py           ``ServerState`` (what a running server holds, resuming unfinished
                       batches) and ``serve()``: the engines, the data folder's lock, uvicorn
    app.py             the FastAPI app: routers, the metrics, API key and body-limit
                       middlewares, /health, /metrics, /v1/models
    errors.py          every error in OpenAI's shape; request bodies parsed (``parsed``)
    chat.py            /v1/chat/completions: a request -> its one question -> chat.completion
                       (or its ``stream: true`` events)
    embeddings.py      /v1/embeddings: requests validated, the engine's embedder, the route
    media.py           which image URLs may be read; a chat image prepared, a small LRU
    engines.py         the HTTP process's side of the engines: engine processes (routing,
                       death and restart) or the engine thread in this process
    engine_process.py  an engine process: the model and its engine thread, over a channel
    channel.py         that channel: pipes of small tuples, pixels in a shared memfd arena
    scheduler.py       the engine thread: interactive requests first, then batch groups
    metrics.py         GET /metrics (prometheus_client): requests, queues, tokens, batches
    files.py           /v1/files: files on disk (list, expiry, delete), routes
    batches.py         /v1/batches: batch records on disk, routes
    batch_worker.py    validates new batches into jobs, writes finished batches' files
    ray_batches.py     ``--executor ray``: each batch a job driven on the Ray executor

``docs/server.md`` has the design; ``vlmbatch/app/model_commands.py`` ``cmd_serve`` starts it.
"""

from vlmbatch.app.server.config import ServerConfig

__all__ = ["ServerConfig"]
