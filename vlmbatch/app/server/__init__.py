"""``vlmbatch serve``: an OpenAI-compatible server over the same engine and job store, one
file per concern.

    config.py        ``ServerConfig`` (the serve command's config root) and its options
    serve.py         ``ServerState`` (what a running server holds, resuming unfinished
                     batches) and ``serve()``: the engine, the data folder's lock, uvicorn
    app.py           the FastAPI app: routers, the API key and body-limit middlewares,
                     /health, /v1/models
    errors.py        every error in OpenAI's shape; request bodies parsed (``parsed``)
    chat.py          /v1/chat/completions: a request -> its one question -> chat.completion
    embeddings.py    /v1/embeddings: requests validated, the engine's embedder, the route
    media.py         which image URLs may be read; a chat image prepared, a small LRU
    scheduler.py     the engine thread: interactive requests first, then batch groups
    batches.py       /v1/files and /v1/batches: files and batch records on disk, routes
    batch_worker.py  validates new batches into jobs, writes finished batches' files

``docs/server.md`` has the design; ``vlmbatch/app/model_commands.py`` ``cmd_serve`` starts it.
"""

from vlmbatch.app.server.config import ServerConfig

__all__ = ["ServerConfig"]
