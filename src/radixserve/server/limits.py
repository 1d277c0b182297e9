"""Limits on what one request may ask for, checked before any work is done.

A server exposed to clients it does not trust must bound every input that costs memory or
time: body bytes (before parsing) and the time to send them, prompt characters (before
tokenizing), prompts and choices per request, stop strings and stop ids, and the number of
requests in flight (429 with ``Retry-After`` beyond the queue). Each limit is a :class:`ServerConfig` field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from radixserve.config import ServerConfig
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
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n < 0 or n > self.max_bytes:
                    resp = error_response(413 if n > 0 else 400,
                                          f"request body too large (limit {self.max_bytes} bytes)"
                                          if n > 0 else "invalid Content-Length", code="body_too_large")
                    await resp(scope, receive, send)
                    return
                break
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


def check_text(value: str, field: str, cfg: ServerConfig) -> None:
    """A prompt or message: not too long, and encodable (no lone surrogates)."""
    if len(value) > cfg.max_prompt_chars:
        raise APIError(400, f"{field} has {len(value)} characters; the limit is {cfg.max_prompt_chars}",
                       param=field, code="prompt_too_long")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{field} contains text that is not valid Unicode (a lone surrogate)",
                       param=field) from None


def check_stops(stop: Any, stop_token_ids: Any, cfg: ServerConfig, field: str = "stop",
                ids_field: str = "stop_token_ids") -> None:
    """Counts and lengths of stop strings and stop ids. Also their types: ``/generate`` gets
    them in a free-form dict, and this runs before SamplingParams would look at them."""
    if stop is not None and not isinstance(stop, (str, list)):
        raise APIError(400, f"{field} must be a string or a list of strings, got {_json_type(stop)}",
                       param=field)
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise APIError(400, f"{ids_field} must be a list of token ids, got {_json_type(stop_token_ids)}",
                       param=ids_field)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > cfg.max_stop_strings:
        raise APIError(400, f"{field} has {len(stops)} strings; the limit is {cfg.max_stop_strings}",
                       param=field)
    for s in stops:
        if isinstance(s, str):
            if len(s) > cfg.max_stop_string_chars:
                raise APIError(400, f"{field}: a stop string has {len(s)} characters; the limit is "
                               f"{cfg.max_stop_string_chars}", param=field)
            check_text(s, field, cfg)
    if stop_token_ids is not None and len(stop_token_ids) > cfg.max_stop_token_ids:
        raise APIError(400, f"{ids_field} has {len(stop_token_ids)} entries; the limit is "
                       f"{cfg.max_stop_token_ids}", param=ids_field)


def check_name(value: str, field: str) -> None:
    """A client-chosen name (a request id): it is echoed in every response and log line, so
    it must be valid Unicode — a lone surrogate cannot be written as UTF-8 JSON."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{field} contains text that is not valid Unicode (a lone surrogate)",
                       param=field) from None


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", dict: "an object", str: "a string"}
    return names.get(type(value), type(value).__name__)


def check_counts(num_prompts: int, n: int, cfg: ServerConfig) -> None:
    if num_prompts > cfg.max_prompts_per_request:
        raise APIError(400, f"the request has {num_prompts} prompts; the limit is "
                       f"{cfg.max_prompts_per_request}", param="prompt")
    if num_prompts * n > cfg.max_choices_per_request:
        raise APIError(400, f"the request asks for {num_prompts * n} choices (prompts x n); the limit "
                       f"is {cfg.max_choices_per_request}", param="n")
