"""Tenants and the prefix-cache namespace of a request, below everything that needs them.

Tenants are the unit of isolation. Each API key belongs to one tenant (``KEY:TENANT``; a key
without a tenant is a tenant of its own); a tenant's requests share cached prefixes only
with that tenant's. The namespace (the salt a worker's radix tree keys a request by) is
derived from the tenant and the request's own ``cache_salt`` (:func:`cache_salt`).

Two places compute it and must agree bit for bit: the server, which keys its tree by it,
and a router in front of several servers, which looks the request up in its mirrors of
those trees. So the key-to-tenant mapping (:class:`KeyRing`) and the derivation live here,
in a module both import, rather than in the server's HTTP layer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Principal", "OPEN", "KeyRing", "parse_key_lines", "bearer_token", "cache_salt"]


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


def bearer_token(authorization: bytes) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` header value (b"" if not one)."""
    return authorization[7:].strip() if authorization[:7].lower() == b"bearer " else b""


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

    def auth_headers(self) -> dict[str, str]:
        """Headers that authenticate a call of one's own to a server holding these keys (the
        admin key if there is one, else the first API key); none without keys."""
        key = self._admin or (self._keys[0][0] if self._keys else None)
        return {"authorization": "Bearer " + key.decode()} if key else {}

    def principal(self, authorization: bytes | None) -> Principal | None:
        """Who sends a request with this ``Authorization`` header value: everyone is
        :data:`OPEN` without keys; with keys, the key's principal, or None (refused)."""
        if not self.enabled:
            return OPEN
        token = bearer_token(authorization or b"")
        return self.authenticate(token) if token else None


def cache_salt(principal: Principal, request_salt: str | None) -> str | None:
    """The prefix-cache namespace of a request: its tenant's, narrowed by its own salt. None (the
    shared default namespace) only without authentication and without a salt. A digest, so neither
    tenant names nor client salts are stored in the tree or published in cache events."""
    if principal.tenant is None and request_salt is None:
        return None
    raw = json.dumps([principal.tenant, request_salt]).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
