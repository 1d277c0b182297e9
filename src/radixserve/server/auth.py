"""Who is calling, checked at the HTTP edge: a bearer key per request, and what it may do.

The keys, their tenants and the cache namespace derived from a tenant live in
:mod:`radixserve.tenancy` (a router computes the same namespace); this module is the
server's gate. The admin key may flush the cache, abort any request and read ``/metrics``
and the server's internal stats. ``/health`` is the only route open without a key. With no
key configured at all the server is single-tenant and open (a local development setup).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from radixserve.server.errors import error_response
from radixserve.tenancy import OPEN, KeyRing, Principal, bearer_token, cache_salt, parse_key_lines

__all__ = ["PUBLIC_PATHS", "ADMIN_PATHS", "AuthMiddleware", "OPEN", "KeyRing", "Principal",
           "cache_salt", "parse_key_lines", "principal_of"]

PUBLIC_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/flush_cache", "/metrics", "/server_info", "/get_server_info", "/debug/integrity"})


class AuthMiddleware:
    """Bearer-token check as plain ASGI (BaseHTTPMiddleware would get in the way of
    streaming responses and disconnect detection). Puts the Principal in
    ``scope["state"]["principal"]``."""

    def __init__(self, app: Any, keyring: KeyRing):
        self.app = app
        self.keyring = keyring

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        refusal = self._authorize(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorize(self, scope: dict) -> JSONResponse | None:
        """Put the caller's Principal in the scope's state, or return the refusal to send."""
        path = scope.get("path", "")
        state = scope.setdefault("state", {})
        if not self.keyring.enabled:
            state["principal"] = OPEN
        elif path in PUBLIC_PATHS or scope.get("method") == "OPTIONS":
            state["principal"] = Principal(None)
        else:
            token = next((bearer_token(v) for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            principal = self.keyring.authenticate(token) if token else None
            if principal is None:
                return error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      "authentication_error", code="invalid_api_key")
            if path in ADMIN_PATHS and not principal.admin:
                return error_response(403, f"{path} needs the admin key", "permission_error", code="admin_only")
            state["principal"] = principal
        return None


def principal_of(request: Request) -> Principal:
    """Who sent ``request``, as :class:`AuthMiddleware` found it (everyone, without keys)."""
    return request.scope.get("state", {}).get("principal", OPEN)
