"""Every error the server sends is OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages",
               "code": "invalid_image"}}

``APIError`` (``serving/errors.py``: plain, the engine side raises it too) is what handlers
raise (``parsed`` turns a body pydantic refuses into the
400 naming its first problem); ``install`` turns it, FastAPI's validation errors,
Starlette's 404/405/413 and anything unexpected (500, logged) into that body. A malformed
request is a 400 (OpenAI's status for an invalid one), never FastAPI's 422.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmbatch.serving.errors import APIError, error_type

log = logging.getLogger("vlmbatch.server")
M = TypeVar("M", bound=BaseModel)
# request bodies: types as declared (no coercion), unknown fields ignored (OpenAI's clients
# send fields of newer API versions)
STRICT = ConfigDict(strict=True, extra="ignore")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None, type_: str | None = None) -> dict[str, Any]:
    t = type_ or error_type(status)
    return {"error": {"message": message, "type": t, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code, e.type), e.status,
                        headers=e.headers() or None)


# labels pydantic puts in an error's location for the member of a union it tried
_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def _param(loc: tuple) -> str | None:
    """FastAPI's error location ``("body", "messages", 0, "content", "list[...]", 1,
    "image_url", "image_url", "url")`` as ``messages[0].content[1].image_url.url``: union
    member labels dropped, a discriminated union's tag merged with its field."""
    out, last = "", None
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or "-" in str(part) or str(part) in _TYPE_LABELS:
            continue
        elif part != last:
            out += f".{part}" if out else str(part)
        last = part
    return out or None


def validation_error(errors: Sequence[Any]) -> APIError:
    """The most specific of a request's problems (FastAPI's or pydantic's error dicts; the
    deepest location: in a union, the member that got furthest), as a 400."""
    if not errors:
        return bad_request("invalid request body")
    first = max(errors, key=lambda x: len(x.get("loc", ())))
    kind = first.get("type", "")
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return bad_request("the request body is not valid JSON", code="invalid_json")
    param = _param(loc)
    if param is None:
        return bad_request("the request body must be a JSON object (Content-Type: "
                           "application/json)", code="invalid_json")
    msg = str(first.get("msg", "invalid value"))
    if kind == "missing":
        return bad_request(f"missing required parameter '{param}'", param,
                           "missing_required_parameter")
    return bad_request(f"invalid value for '{param}': {msg}", param, "invalid_value")


def parsed(model: type[M], body: bytes) -> M:
    """``body`` parsed and validated as ``model`` (pydantic's JSON parser, in one pass), or
    the 400 naming the first problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def install(app: FastAPI) -> None:
    """Register the handlers that give every error OpenAI's shape."""

    async def api_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, APIError)
        return error_response(e)

    async def invalid(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, RequestValidationError)
        return error_response(validation_error(e.errors()))

    async def http_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, StarletteHTTPException)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"
                   }.get(e.status_code, str(e.detail))
        code = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"
                }.get(e.status_code)
        return error_response(APIError(e.status_code, message, code=code))

    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}",
                                       code="internal_error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
