"""Limits on reading a request body, checked before it is parsed.

A server exposed to clients it does not trust must bound every input that costs memory or
time: here body bytes and the time to send them; prompt characters, prompts and choices per
request, stop strings and stop ids are rules of the protocol
(:class:`radixserve.protocol.rules.RequestLimits`), and the requests in flight are bounded
by ``ServerContext.admit`` (429 with ``Retry-After`` beyond the queue). Each limit is a
:class:`ServerConfig` field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from radixserve.server.errors import APIError, error_response


class BodyLimitMiddleware:
    """Bounds on reading a request body: 413 past ``max_bytes`` (at once from Content-Length,
    else while reading a chunked body), 408 when the whole body has not arrived ``timeout_s``
    after the headers. Either answer closes the connection: the rest of the body is never
    read, so the connection cannot carry another request.

    The refusal is raised inside ``receive`` — where the app is reading — and the app's own
    answer to the broken read (FastAPI makes any failure there a 400) is replaced by this
    one, whatever route or framework code read the body."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refused_length(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        seen = 0
        body_done = started = False
        refused: APIError | None = None

        async def bounded_receive() -> dict:
            nonlocal seen, body_done, refused
            if refused is not None:
                return {"type": "http.disconnect"}
            if body_done:  # after the body: waiting for a disconnect has no deadline
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                refused = APIError(408, f"the request body was not received within {self.timeout_s:g}s",
                                   code="body_timeout")
                raise refused from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    refused = APIError(413, f"request body too large (limit {self.max_bytes} bytes)",
                                       code="body_too_large")
                    raise refused
                body_done = not msg.get("more_body", False)
            return msg

        async def answer_unless_refused(msg: dict) -> None:
            nonlocal started
            if refused is not None:
                return  # the app's answer to a body it could not read: ours replaces it
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, bounded_receive, answer_unless_refused)
        except Exception:
            if refused is None:
                raise
        if refused is not None and not started:
            resp = error_response(refused.status, refused.message, code=refused.code,
                                  headers={"Connection": "close"})
            await resp(scope, receive, send)

    def _refused_length(self, scope: dict) -> Any:
        """The answer to a Content-Length over the limit (or not a number), else None."""
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if 0 <= n <= self.max_bytes:
                    return None
                return error_response(413 if n > 0 else 400, f"request body too large (limit {self.max_bytes} bytes)"
                                      if n > 0 else "invalid Content-Length", code="body_too_large")
        return None
