"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Bad input is a 4xx that names the field, never a 500: validation errors (pydantic), our own
``ValueError`` s (SamplingParams, the engine's checks, chat templates) and explicit
:class:`APIError` s all end up here. A stream that has already sent its status line reports
an error as one last SSE chunk in the same shape.

Anything else is a bug, answered by :class:`InternalErrorMiddleware` as a JSON 500 in the
same shape. It must not reach uvicorn: uvicorn closes the connection of a request whose
handler raised, and a client that reuses a kept-alive connection then fails on its next,
innocent request.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.engine.client import EngineDeadError
from radixserve.protocol.rules import ProtocolError

logger = logging.getLogger("radixserve.server")


class APIError(Exception):
    """An error answered in OpenAI's shape with a chosen HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type, "param": param, "code": code}},
        headers=headers,
    )


def unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}", "service_unavailable",
                    code="engine_unavailable", headers={"Retry-After": "5"})


def error_chunk(message: str, type: str = "server_error", code: int = 500) -> str:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n"


_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?::| must| has| is)")


def _param_of(message: str) -> str | None:
    """The field a ValueError message starts with ("top_p must be ...", "stop: ...")."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind = e.get("type")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({e.get('msg', '')})", None
    if kind == "missing" and param:
        return f"{param}: field required", param
    if kind == "missing":
        return "the request body is empty; send a JSON object", None
    if kind == "extra_forbidden" and param:
        return f"{param}: unknown field (not supported by this server)", param
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object (send Content-Type: application/json)", None
    msg = e.get("msg", "invalid value")
    if isinstance(e.get("ctx", {}).get("error"), ProtocolError):  # a rule of protocol/rules.py
        return e["ctx"]["error"].message, e["ctx"]["error"].param
    if kind == "value_error" and e.get("ctx", {}).get("error") is not None:
        msg = str(e["ctx"]["error"])  # our own validator's words, without pydantic's "Value error, "
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(ProtocolError)
    async def _protocol(_: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(400, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        # SamplingParams, the engine's checks and chat templates raise ValueError naming the field.
        msg = str(exc).replace("SamplingParams.", "")
        return error_response(400, msg, param=_param_of(msg))

    @app.exception_handler(UnicodeError)
    async def _unicode(_: Request, exc: UnicodeError) -> JSONResponse:
        return error_response(400, f"the request contains text that is not valid Unicode ({exc})")

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return await _api(request, unavailable(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)


class InternalErrorMiddleware:
    """Turns an exception no handler answered into a JSON 500 (OpenAI's shape) that keeps
    the connection open. Starlette's own catch-all sends its 500 and then re-raises, which
    makes uvicorn drop the connection; this one, installed outermost, swallows it once the
    answer is complete. A response already under way cannot be answered any more: it is cut,
    and the connection with it (the client must not mistake a truncated body for a whole
    one)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        async def tracking_send(msg: dict) -> None:
            nonlocal started, complete
            if msg["type"] == "http.response.start":
                started = True
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                complete = True
            await send(msg)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if complete:
                return
            if started:
                raise
            await error_response(500, f"internal error: {type(exc).__name__}", "server_error")(scope, receive, send)
