"""How a request can fail, on either side of the engine channel: ``APIError`` (an HTTP
status with OpenAI's error fields: what the engine side raises for a full queue, a server
shutting down or an engine failure, and what every route raises) and ``EmbedRefused`` (an
embedding input the engine will not take: a 400 naming the input).

Plain exceptions, no web framework: the HTTP side (``server/errors.py``) turns them
into OpenAI's error bodies. Across the channel they travel as ``messages.Failure``
(``failure_of`` / ``Failure.exception``): an exception's own pickle would call ``__init__``
with the message alone.
"""

from __future__ import annotations

INVALID = "invalid_request_error"
# OpenAI's error types by status, for errors raised without one
TYPES = {400: INVALID, 401: "authentication_error", 403: "permission_error",
         404: INVALID, 405: INVALID, 409: INVALID, 413: INVALID, 429: "rate_limit_error",
         500: "server_error", 501: "not_implemented", 503: "server_error"}


def error_type(status: int) -> str:
    return TYPES.get(status, INVALID if status < 500 else "server_error")


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or error_type(status)
        self.retry_after = retry_after  # seconds: a Retry-After header (503 while restarting)

    def headers(self) -> dict[str, str]:
        h = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            h["Retry-After"] = str(self.retry_after)
        return h


def queue_full(limit: int) -> APIError:
    return APIError(429, f"the server has {limit} requests queued; retry shortly",
                    code="queue_full")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")


class EmbedRefused(ValueError):
    """An input the embedding engine will not take (over a token limit, an undecodable
    image): answered 400. ``index``: which input, when one is to blame."""

    def __init__(self, message: str, index: int | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.index, self.code = index, code
