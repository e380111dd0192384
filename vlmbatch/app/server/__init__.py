"""``vlmbatch serve``: an OpenAI-compatible server over the same engine and job store.

    app.py           the FastAPI app: routers, error shapes, API key, body limit
    routes.py        /health, /v1/models, /v1/chat/completions, /v1/embeddings
    batch_routes.py  /v1/files, /v1/batches
    chat.py          a chat request -> its one question; a Score -> chat.completion
    embeddings.py    embedding requests, validated, and the Embedder interface
    images.py        a request's image: media policy, decode, a small LRU
    media.py         which image URLs may be read (data:, file:// under a folder)
    scheduler.py     the engine thread: interactive requests first, then batch groups
    job_run.py       one batch's job, a group at a time
    batches.py       batch records on disk; batch_worker.py validates and finalizes
    files.py         uploaded and output files on disk
    state.py         what a running server holds; resuming unfinished batches
    run.py           serve(): the engine, the data folder's lock, uvicorn

``docs/server.md`` has the design; ``vlmbatch/app/model_commands.py`` ``cmd_serve`` starts it.
"""

from vlmbatch.app.server.config import ServerConfig

__all__ = ["ServerConfig"]
