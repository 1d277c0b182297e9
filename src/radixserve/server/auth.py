"""Who is calling: API keys bound to tenants, an admin key, and what each may do.

Tenants are the unit of isolation. Each key belongs to one tenant (``KEY:TENANT``; a key
without a tenant is a tenant of its own); a tenant's requests share cached prefixes only
with that tenant's (the cache salt is derived here from the tenant and the request's own
``cache_salt``), see only their own request ids, and see no server-wide cache counters.
The admin key may flush the cache, abort any request and read ``/metrics`` and the
server's internal stats. ``/health`` is the only route open without a key. With no key
configured at all the server is single-tenant and open (a local development setup).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.server.errors import error_response

PUBLIC_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/flush_cache", "/metrics", "/server_info", "/get_server_info",
                         "/debug/integrity"})


@dataclass(frozen=True)
class Principal:
    """The caller of one request. ``tenant`` is None when authentication is off."""

    tenant: str | None
    admin: bool = False


OPEN = Principal(None, admin=True)


def _tenant_of_key(key: str) -> str:
    # A key alone names a tenant of its own; only a digest of it is ever kept or logged.
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_lines(lines: Sequence[str], source: str) -> list[tuple[str, str]]:
    """``KEY`` or ``KEY:TENANT`` lines (blank lines and ``#`` comments skipped)."""
    out = []
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, tenant = line.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not key:
            raise ValueError(f"{source} line {n}: empty API key")
        if sep and not tenant:
            raise ValueError(f"{source} line {n}: empty tenant name after ':'")
        out.append((key, tenant or _tenant_of_key(key)))
    return out


class KeyRing:
    """The configured keys; ``authenticate`` maps a request's bearer token to a Principal."""

    def __init__(self, api_keys: Sequence[str] = (), api_key_file: str = "", admin_key: str = ""):
        pairs = parse_key_lines(list(api_keys), "--api-key")
        if api_key_file:
            with open(api_key_file, encoding="utf-8") as f:
                pairs += parse_key_lines(f.read().splitlines(), api_key_file)
        if admin_key is not None and admin_key != "" and not admin_key.strip():
            raise ValueError("admin_key must not be blank")
        self._keys = [(k.encode(), t) for k, t in pairs]
        self._admin = admin_key.encode() if admin_key else None
        self.enabled = bool(self._keys or self._admin)
        self.tenants = sorted({t for _, t in pairs})

    def authenticate(self, token: bytes) -> Principal | None:
        """The principal of a bearer token (constant-time comparisons), or None."""
        found: Principal | None = None
        if self._admin is not None and hmac.compare_digest(token, self._admin):
            found = Principal("admin", admin=True)
        for key, tenant in self._keys:
            if hmac.compare_digest(token, key) and found is None:
                found = Principal(tenant)
        return found


def cache_salt(principal: Principal, request_salt: str | None) -> str | None:
    """The prefix-cache namespace of a request: its tenant's, narrowed by its own salt.

    None (the shared default namespace) only without authentication and without a salt.
    A digest, so neither tenant names nor client salts are stored in the tree or published
    in cache events."""
    if principal.tenant is None and request_salt is None:
        return None
    raw = json.dumps([principal.tenant, request_salt]).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class AuthMiddleware:
    """Bearer-token check as plain ASGI (BaseHTTPMiddleware would get in the way of
    streaming responses and disconnect detection). Puts the Principal in
    ``scope["state"]["principal"]``."""

    def __init__(self, app: Any, keyring: KeyRing):
        self.app = app
        self.keyring = keyring

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        state = scope.setdefault("state", {})
        if not self.keyring.enabled:
            state["principal"] = OPEN
            await self.app(scope, receive, send)
            return
        if path in PUBLIC_PATHS or scope.get("method") == "OPTIONS":
            state["principal"] = Principal(None)
            await self.app(scope, receive, send)
            return
        token = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                token = v[7:].strip() if v[:7].lower() == b"bearer " else b""
                break
        principal = self.keyring.authenticate(token) if token else None
        if principal is None:
            resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  "authentication_error", code="invalid_api_key")
            await resp(scope, receive, send)
            return
        if path in ADMIN_PATHS and not principal.admin:
            resp = error_response(403, f"{path} needs the admin key", "permission_error",
                                  code="admin_only")
            await resp(scope, receive, send)
            return
        state["principal"] = principal
        await self.app(scope, receive, send)
