"""SGLang's ``/open_session`` and ``/close_session``.

A session is opened by the first request that names it (how a request names one, and the
rules for session ids: :mod:`radixserve.server.session_ids`); the engine then keeps the
conversation's cached KV between its turns (:mod:`radixserve.sched.sessions`).
``/open_session`` is only needed for a TTL of its own (``timeout``) or a generated id.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request

from radixserve.protocol.native import CloseSessionRequest, OpenSessionRequest
from radixserve.server.auth import principal_of
from radixserve.server.errors import APIError
from radixserve.server.session_ids import checked_session_id, session_key

__all__ = ["register"]


def register(app: FastAPI, srv: Any) -> None:
    async def open_session(body: OpenSessionRequest, request: Request) -> Any:
        """Open a session and return its id (SGLang answers with the bare id as JSON)."""
        srv.check_ready()
        sid = checked_session_id(body.session_id, "session_id") if body.session_id is not None else uuid.uuid4().hex
        try:
            ok = await srv.client.call("open_session", session_id=session_key(principal_of(request), sid),
                                       ttl_s=body.timeout)
        except ValueError as e:  # sessions off, a bad timeout
            raise APIError(400, str(e), param="timeout" if "timeout" in str(e) else None) from None
        if not ok:
            raise APIError(400, f"session {sid!r} is already open", param="session_id", code="session_exists")
        return sid

    async def close_session(body: CloseSessionRequest, request: Request) -> dict[str, Any]:
        """End a session; the KV it keeps is released at once."""
        srv.check_ready()
        sid = checked_session_id(body.session_id, "session_id")
        ok = await srv.client.call("close_session", session_id=session_key(principal_of(request), sid))
        return {"success": bool(ok)}

    # One route per method: a route with two methods gets one OpenAPI operation id for both.
    for method in ("POST", "GET"):
        app.add_api_route("/open_session", open_session, methods=[method], name=f"open_session_{method.lower()}")
        app.add_api_route("/close_session", close_session, methods=[method], name=f"close_session_{method.lower()}")
