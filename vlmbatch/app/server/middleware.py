"""Two ASGI middlewares that run before any endpoint: the API key and the body size limit.

``ApiKey``: with a key set, every path but ``/health`` needs ``Authorization: Bearer KEY``;
the comparison is ``hmac.compare_digest`` on bytes (constant time whatever the guess).
``BodyLimit``: a declared ``Content-Length`` over the limit is refused at once (413); a
chunked body is counted as it is read, and the read that crosses the limit raises a 413
``HTTPException``, which FastAPI passes through its body parsing to the error handlers.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmbatch.app.server.errors import error_body

OPEN_PATHS = {"/health"}


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
