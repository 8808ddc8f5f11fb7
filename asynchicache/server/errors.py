"""OpenAI-shaped errors: every failure answers `{"error": {message, type, param, code}}`.

Clients written against the OpenAI API parse this body to raise their own
exceptions, so validation errors, unknown routes and auth failures all use it,
never FastAPI's default `{"detail": ...}`. `JSONErrors`, the outermost layer,
covers what escapes the app itself (a task cancelled at shutdown, an app that
returned without answering): uvicorn would answer those with a plain-text 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, phrased for a person, with its field path as `param`."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    # loc starts with "body"; the rest is the field path, e.g. body.messages.0.content,
    # with the names of union members pydantic tried ("list[str]", "function-after[...]")
    # left out: a client wants the field.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and _is_field(p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    where = f"'{param}': " if param else ""
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param)


def _is_field(part: object) -> bool:
    return isinstance(part, int) or (isinstance(part, str) and part.isidentifier())


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _validation_error(exc).response()


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return APIError(exc.status_code, str(exc.detail)).response()


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error while serving a request")
    return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


class JSONErrors:
    """Outermost ASGI layer: a request the app leaves unanswered gets a JSON error
    (503 when it was cancelled, at shutdown; 500 otherwise) instead of uvicorn's
    plain-text 500. The exception still propagates (uvicorn logs it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not started:
                await _send_error(send, APIError(503, "the server is shutting down"))
            raise
        except Exception:
            if not started:
                await _send_error(send, APIError(500, "internal error", type_="server_error"))
            raise
        if not started:
            log.error("a request ended without an answer; answered 500")
            await _send_error(send, APIError(500, "internal error", type_="server_error"))


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    with contextlib.suppress(Exception):  # the client may be gone already
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
