"""Session ids over HTTP: which session a request names, and the key the engine core knows it by.

A request names its conversation with the ``X-Session-Id`` header (any route), the
``session_id`` body field (OpenAI routes) or SGLang's ``session_params: {"id": ...}``
(``/generate``). Session ids are names in the caller's tenant namespace, as client request
ids are: with authentication on, the core sees a digest of (tenant, id), so one tenant can
neither close nor extend another's session.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import Request

from radixserve.sched.sessions import check_session_id
from radixserve.server.auth import Principal
from radixserve.server.errors import APIError

HEADER = "x-session-id"

__all__ = ["HEADER", "checked_session_id", "request_session_id", "session_key"]


def checked_session_id(value: Any, field: str) -> str | None:
    """A session id as the core accepts it, or a 400 naming ``field``."""
    try:
        return check_session_id(value, field)
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None


def request_session_id(request: Request, body_value: Any = None, field: str = "session_id") -> str | None:
    """The session a request names (header or body; both must agree), validated (400)."""
    header = request.headers.get(HEADER)
    sid = checked_session_id(body_value, field)
    if header is not None:
        header = checked_session_id(header, "X-Session-Id")
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
    return "t-" + hashlib.blake2b(json.dumps([principal.tenant, session_id]).encode(), digest_size=16).hexdigest()
