"""Sessions over HTTP: the id a request carries, and SGLang's ``/open_session`` and ``/close_session``.

A request names its conversation with the ``X-Session-Id`` header (any route), the
``session_id`` body field (OpenAI routes) or SGLang's ``session_params: {"id": ...}``
(``/generate``); the engine then keeps the conversation's cached KV between its turns
(:mod:`radixserve.sched.sessions`). A session is opened by its first request;
``/open_session`` is only needed for a TTL of its own (``timeout``) or a generated id.

Session ids are names in the caller's tenant namespace, as client request ids are: with
authentication on, the core sees a digest of (tenant, id), so one tenant can neither close
nor extend another's session.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from fastapi import FastAPI, Request

from radixserve.protocol.native import CloseSessionRequest, OpenSessionRequest
from radixserve.sched.sessions import check_session_id
from radixserve.server.auth import Principal
from radixserve.server.errors import APIError

HEADER = "x-session-id"

__all__ = ["HEADER", "register", "request_session_id", "session_key"]


def _checked(value: Any, field: str) -> str | None:
    try:
        return check_session_id(value, field)
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None


def request_session_id(request: Request, body_value: Any = None, field: str = "session_id") -> str | None:
    """The session a request names (header or body; both must agree), validated (400)."""
    header = request.headers.get(HEADER)
    sid = _checked(body_value, field)
    if header is not None:
        header = _checked(header, "X-Session-Id")
        if sid is not None and sid != header:
            raise APIError(400, f"X-Session-Id ({header!r}) and {field} ({sid!r}) name different sessions",
                           param=field)
        sid = header
    return sid


def session_key(principal: Principal, session_id: str | None) -> str | None:
    """The id the engine core keys the session by: the client's own without authentication,
    else a digest of (tenant, id)."""
    if session_id is None or principal.tenant is None:
        return session_id
    return "t-" + hashlib.blake2b(json.dumps([principal.tenant, session_id]).encode(),
                                  digest_size=16).hexdigest()


def register(app: FastAPI, srv: Any) -> None:
    from radixserve.server.openai_routes import principal_of

    async def open_session(body: OpenSessionRequest, request: Request) -> Any:
        """Open a session and return its id (SGLang answers with the bare id as JSON)."""
        srv.check_ready()
        sid = _checked(body.session_id, "session_id") if body.session_id is not None else uuid.uuid4().hex
        try:
            ok = await srv.client.call("open_session", session_id=session_key(principal_of(request), sid),
                                       ttl_s=body.timeout)
        except ValueError as e:  # sessions off, a bad timeout
            raise APIError(400, str(e), param="timeout" if "timeout" in str(e) else None) from None
        if not ok:
            raise APIError(400, f"session {sid!r} is already open", param="session_id",
                           code="session_exists")
        return sid

    async def close_session(body: CloseSessionRequest, request: Request) -> dict[str, Any]:
        """End a session; the KV it keeps is released at once."""
        srv.check_ready()
        sid = _checked(body.session_id, "session_id")
        ok = await srv.client.call("close_session", session_id=session_key(principal_of(request), sid))
        return {"success": bool(ok)}

    # One route per method: a route with two methods gets one OpenAPI operation id for both.
    for method in ("POST", "GET"):
        app.add_api_route("/open_session", open_session, methods=[method],
                          name=f"open_session_{method.lower()}")
        app.add_api_route("/close_session", close_session, methods=[method],
                          name=f"close_session_{method.lower()}")
