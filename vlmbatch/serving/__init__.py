"""The engine side of ``vlmbatch serve``: everything that runs the model for the server and
nothing of the web (no FastAPI, Starlette, pydantic or uvicorn: ``tests/test_layers.py``
checks it), so an engine process loads only what answering needs. The HTTP side
(``server/``) parses requests and renders answers; this package takes a prepared
image and a ``Question`` (or a batch's job folder) and gives back a ``Score`` (or the
job's results in its store).

    config.py          ``ServingConfig``: what the engine side is started with (the part
                       of the server's config an engine process needs)
    errors.py          how a request fails on either side: ``APIError`` (an HTTP status
                       and OpenAI's error fields, plain), ``EmbedRefused``
    messages.py        the channel's records, one frozen dataclass per kind (``Ask``,
                       ``Settled``, ``RunBatch``, ``BatchDrained``, ...)
    channel.py         the channel itself: pipes of pickled records, pixels in a shared
                       memfd arena, the count of requests on their way
    scheduler.py       the engine thread: interactive questions first (batched into one
                       engine call), then batch jobs a group at a time
    engine_process.py  an engine process: the engines and their engine thread, over a
                       channel
    engines.py         the HTTP process's handle on the engines (``Engines``), and the
                       engine thread in the HTTP process itself (``LocalEngines``)
    processes.py       ``EngineProcesses``: engine processes, routing, death and restart
    embed.py           embeddings on the engines: what the endpoint hands over and gets
                       back, the backend that runs the drive loop's two stages

Named ``serving`` (the engine side of serving) rather than ``server``: it is not a
server, and ``server/`` (the HTTP side, a row above it) imports it, never the reverse.
``docs/server.md`` has the design.
"""
