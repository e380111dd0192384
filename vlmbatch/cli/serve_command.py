"""``vlmbatch serve``: the OpenAI-compatible server (``server/``). Its own module, imported
only when ``serve`` runs (``commands.HANDLERS``), so that no other command loads the HTTP
stack (FastAPI, Starlette, uvicorn, pydantic: ``tests/cli/test_startup.py``)."""

from __future__ import annotations

from vlmbatch.cli.args import CommandLine
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.pipeline.hooks import NO_HOOKS, FaultHooks
from vlmbatch.server.config import server_config
from vlmbatch.server.serve import serve


def cmd_serve(line: CommandLine, hooks: FaultHooks = NO_HOOKS) -> int:
    serve(server_config(line.typed), hooks)  # until SIGTERM or Ctrl-C
    return EXIT_OK
