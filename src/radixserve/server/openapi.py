"""The OpenAPI document (``/openapi.json``, ``/docs``) as the server actually answers.

FastAPI documents a 422 with its own validation-error shape on every route that takes a body;
this server answers 400 in OpenAI's error shape instead (``server/errors.py``), and 408 / 413
for bodies it cannot read. Generated clients and gateways trust the document, so it is
rewritten to say that, and every operation gets a ``default`` error in the same shape (401,
429, 503, ...).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}

#: ``{"error": {"message", "type", "param", "code"}}``, every error this server sends.
ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "description": "invalid_request_error, server_error, ..."},
            "param": {"type": ["string", "null"], "description": "the request field at fault"},
            "code": {"type": ["string", "integer", "null"]},
        },
    }},
}


def error_response_doc(description: str) -> dict[str, Any]:
    """A response entry whose body is :data:`ERROR_SCHEMA` (for a route's ``responses=``)."""
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


_BODY_ERRORS = {
    "400": "Invalid request: a field missing, unknown, of the wrong type or out of range (param names it)",
    "408": "The request body was not received in time",
    "413": "The request body is too large",
}


#: The routes that read ``X-Cache-Low-Priority-From`` (server/cache_hint.py), read by hand
#: from the request, so FastAPI cannot see it.
CACHE_HINT_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")

CACHE_HINT_PARAM: dict[str, Any] = {
    "name": "X-Cache-Low-Priority-From", "in": "header", "required": False,
    "schema": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    "description": "Token position from which what this request caches is evicted first (its own "
                   "tail, past what its family of prompts shares); set by radixserve router. "
                   "Anything else is a 400 naming the header.",
}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the rewritten document (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _truthful(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _truthful(doc: dict[str, Any]) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            if path in CACHE_HINT_PATHS and method == "post":
                op.setdefault("parameters", []).append(CACHE_HINT_PARAM)
            responses = op.setdefault("responses", {})
            validated = responses.pop("422", None) is not None
            if validated or "requestBody" in op:
                for status, text in _BODY_ERRORS.items():
                    responses.setdefault(status, error_response_doc(text))
            responses.setdefault("default", error_response_doc(
                "An error in OpenAI's shape (401 without a valid key, 429 at capacity, 503 while "
                "the engine is unavailable, 500 for a bug)"))
    return doc


__all__ = ["ERROR_SCHEMA", "error_response_doc", "install_openapi"]
