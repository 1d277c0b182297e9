"""The router's HTTP front: a plain ASGI app (served by uvicorn) that proxies to workers.

Plain ASGI rather than FastAPI: the router validates nothing (the worker does, and its
answer, error or not, is passed through byte for byte), so a framework's routing and
validation would only add per-request cost.

Generation endpoints (``/v1/completions``, ``/v1/chat/completions``, ``/generate``): the
body is parsed once to tokenize the prompt, the policy picks a worker, and the original
bytes are forwarded (:mod:`.upstream`: keep-alive pools, no framework). Non-streamed: the
answer is relayed once complete; a transport failure (connection refused or reset, timeout,
the worker taken out while the request ran, or a 503) retries the request on another
worker, up to ``max_retries`` times. Streamed: the response starts with the worker's first
chunk (so a worker that fails before answering is retried like a non-streamed request),
then chunks are relayed as they arrive; a failure after that ends the stream with an
OpenAI-shaped error chunk and ``data: [DONE]``.

Other endpoints: ``/v1/models``, ``/get_model_info``, ``/model_info``, ``/server_info``,
``/get_server_info``, ``/health_generate`` go to one available worker; ``/flush_cache`` and
``/abort_request`` to all; ``/health`` answers for the router (200 while a worker is
available); ``/metrics`` sums the workers' metrics and adds the router's;
``/router/workers`` shows each worker's health, load and mirror.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from radixserve.router.fleet import NoWorkerAvailable, Router
from radixserve.router.metrics import render_metrics
from radixserve.router.upstream import UpstreamError, UpstreamTimeout
from radixserve.placement.worker import Ticket, Worker

__all__ = ["RouterApp"]

logger = logging.getLogger("radixserve.router")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
#: The worker's header for the policy's cache hint (``radixserve.server.cache_hint``); a
#: client's own is passed on as it is.
LOW_PRIORITY_HEADER = "x-cache-low-priority-from"
_FORWARD_HEADERS = (b"authorization", b"x-request-id", LOW_PRIORITY_HEADER.encode())


class _Retryable(Exception):
    """The worker failed before answering: the request may go to another worker."""


@dataclass(frozen=True)
class _Upstream:
    """What every attempt of one request sends to a worker."""

    path: str
    body: bytes
    headers: Dict[str, str]
    stream: bool
    hint: bool  # the policy's cache hint may be passed on (one prompt, routed by its own keys)


@dataclass
class _Progress:
    started: bool = False  # response start sent to the client


def _error_body(status: int, message: str, type: str = "server_error", code: Any = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code if code is not None else status}}).encode()


def _sse_error(message: str, code: int = 502) -> bytes:
    return b"data: " + _error_body(code, message) + b"\n\ndata: [DONE]\n\n"


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _wait_disconnect(receive: Callable) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _respond(send: Callable, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RouterApp:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._routes: Dict[Tuple[str, str], Callable[..., Awaitable[None]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._forward_one,
            ("GET", "/get_model_info"): self._forward_one,
            ("GET", "/server_info"): self._forward_one,
            ("GET", "/get_server_info"): self._forward_one,
            ("GET", "/health_generate"): self._forward_one,
            ("GET", "/model_info"): self._forward_one,
            ("GET", "/flush_cache"): self._flush_cache,
            ("POST", "/flush_cache"): self._flush_cache,
            ("POST", "/abort_request"): self._abort_request,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/router/workers"): self._workers,
        }

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return
        path, method = scope["path"], scope["method"]
        started = False

        async def tracked_send(msg: dict) -> None:
            nonlocal started
            started = True
            await send(msg)

        try:
            if method == "POST" and path in GENERATION_PATHS:
                await self._generation(scope, receive, tracked_send, path)
                return
            handler = self._routes.get((method, path))
            if handler is None:
                known = {p for _, p in self._routes} | set(GENERATION_PATHS)
                status = 405 if path in known else 404
                await _respond(send, status, _error_body(
                    status, f"{method} {path} is not served by the router",
                    "not_found_error" if status == 404 else "invalid_request_error"))
                return
            await handler(scope, receive, tracked_send)
        except ConnectionResetError:
            return  # the client left before we answered
        except Exception as e:  # a bug of ours: answer it rather than drop the connection
            logger.exception("router error on %s %s", method, path)
            if not started:
                await _respond(send, 500, _error_body(500, f"router error: {type(e).__name__}: {e}"))

    # ------------------------------------------------------------------ lifespan
    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.router.start()
                except Exception as e:
                    logger.exception("router failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.router.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ generation
    @staticmethod
    def _upstream_headers(scope: dict, json_body: bool = True) -> Dict[str, str]:
        h = {"content-type": "application/json"} if json_body else {}
        for k, v in scope.get("headers", ()):
            if k in _FORWARD_HEADERS:
                h[k.decode()] = v.decode("latin-1")
        return h

    @staticmethod
    def _authorization(scope: dict) -> Optional[bytes]:
        return next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)

    async def _generation(self, scope: dict, receive: Callable, send: Callable, path: str) -> None:
        router = self.router
        body = await _read_body(receive)
        obj, tokens, salt = await self._routing_key(scope, path, body)
        # The policy's cache hint holds for the prompt it routed by, in the worker's keys.
        hint = bool(tokens) and not router.tokenizer.is_batch(path, obj) \
            and not router.tokenizer.fetched_images(path, obj)
        upstream = _Upstream(path, body, self._upstream_headers(scope), obj.get("stream") is True, hint)
        router.requests += 1
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        tried: List[Worker] = []
        last_error = "no worker is available"
        try:
            for attempt in range(router.config.max_retries + 1):
                try:
                    ticket = router.pick(tokens, salt, tried)
                except NoWorkerAvailable as e:
                    last_error = str(e) if not tried else f"{e}; last error: {last_error}"
                    break
                if attempt:
                    router.retries += 1
                failed = await self._attempt(ticket, upstream, send, disconnect)
                if failed is None:
                    return
                last_error = f"worker {ticket.worker.url}: {failed[0]}"
                if await self._answered_failure(ticket, last_error, *failed, send):
                    return
                tried.append(ticket.worker)
            router.failed_requests += 1
            status = 503 if not tried else 502
            await _respond(send, status, _error_body(status, f"request failed: {last_error}"))
        finally:
            disconnect.cancel()

    async def _routing_key(self, scope: dict, path: str, body: bytes) -> Tuple[dict, bytes, Optional[str]]:
        """The body as JSON (empty when it is not an object), and the prompt's keys and cache
        namespace to route by (empty: route by load; a worker words any error)."""
        router = self.router
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError:
            return {}, b"", None  # let a worker word the error, as it would without a router
        try:
            if router.tokenizer.has_images(obj):  # decoding and hashing: off the loop
                tokens, salt = await asyncio.to_thread(router.tokenizer.for_path, path, obj)
            else:
                tokens, salt = router.tokenizer.for_path(path, obj)
        except Exception:
            return obj, b"", None  # unroutable by prefix: by load; the worker answers the error
        return obj, tokens, router.namespace(self._authorization(scope), salt) if tokens else salt

    async def _attempt(self, ticket: Ticket, up: "_Upstream", send: Callable,
                       disconnect: asyncio.Future) -> Optional[Tuple[str, asyncio.Future, "_Progress"]]:
        """Send the request to the ticket's worker. None: answered (or the client left);
        else why it failed, the call and how far its answer got."""
        router = self.router
        progress = _Progress()
        sent = up.headers
        if up.hint and ticket.low_priority_from is not None and LOW_PRIORITY_HEADER not in sent:
            sent = {**sent, LOW_PRIORITY_HEADER: str(ticket.low_priority_from)}
        call = asyncio.ensure_future(self._call(ticket, up.path, up.body, sent, up.stream, send, progress))
        ticket.task = call
        done, _ = await asyncio.wait({call, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if call not in done:  # the client went away: drop the upstream call too
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            router.finish(ticket, True)
            return None
        try:
            err = self._failure(call, ticket)
        except BaseException:
            router.finish(ticket, True)  # a bug of ours, not the worker's failure
            raise
        router.finish(ticket, err is None)
        return None if err is None else (err, call, progress)

    async def _answered_failure(self, ticket: Ticket, last_error: str, err: str, call: asyncio.Future,
                                progress: "_Progress", send: Callable) -> bool:
        """Answer a failed attempt when another cannot be made (True), else count the retry."""
        router = self.router
        timed_out = not call.cancelled() and isinstance(call.exception(), UpstreamTimeout)
        logger.warning("request to %s failed (%s)%s", ticket.worker.url, err,
                       "" if progress.started or timed_out else "; retrying elsewhere")
        if timed_out and not progress.started:
            # It may still be running there: sending it again would double the work.
            router.failed_requests += 1
            await _respond(send, 504, _error_body(504, f"request timed out: {last_error}"))
            return True
        if progress.started:
            router.stream_errors += 1
            await send({"type": "http.response.body",
                        "body": _sse_error(f"the worker failed mid-stream: {last_error}"), "more_body": False})
            return True
        return False

    @staticmethod
    def _failure(call: asyncio.Future, ticket: Ticket) -> Optional[str]:
        """Why the upstream call failed (None: it succeeded)."""
        if call.cancelled():
            return "the worker was taken out while the request ran" if ticket.worker_down else "cancelled"
        e = call.exception()
        if e is None:
            return None
        if isinstance(e, (_Retryable, UpstreamError)):
            return str(e)
        if isinstance(e, (ConnectionError, OSError)):
            return f"{type(e).__name__}: {e}"
        raise e  # a bug of ours: let it surface

    async def _call(self, ticket: Ticket, path: str, body: bytes, headers: Dict[str, str],
                    stream: bool, send: Callable, progress: _Progress) -> None:
        client = self.router.client
        assert client is not None
        resp = await client.request("POST", ticket.worker.url, path, body, headers)
        if resp.status == 503:
            data = await resp.read()
            raise _Retryable(f"HTTP 503: {data[:200]!r}")
        ctype = resp.content_type.encode()
        if not stream or resp.status != 200:
            data = await resp.read()
            await _respond(send, resp.status, data, ctype)
            return
        try:
            async for chunk in resp.chunks():
                if not chunk:
                    continue
                if not progress.started:
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", ctype), (b"cache-control", b"no-cache")]})
                    progress.started = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            resp.close()  # no-op once the body was read to its end
        if not progress.started:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
            progress.started = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ------------------------------------------------------------------ other endpoints
    async def _health(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.router.available():
            await _respond(send, 200, b"")
        else:
            await _respond(send, 503, _error_body(503, "no worker is available"))

    async def _get_any(self, path: str, scope: dict) -> Tuple[int, bytes, bytes]:
        """GET ``path`` from one available worker (the next one if it fails): ``(status, content type, body)``."""
        router = self.router
        assert router.client is not None
        tried: List[Worker] = []
        last: Optional[Exception] = None
        for _ in range(len(router.workers)):
            try:
                w = router.least_loaded(tried)
            except NoWorkerAvailable:
                break
            try:
                status, ctype, data = await router.client.fetch(
                    "GET", w.url, path, headers=self._upstream_headers(scope, json_body=False))
                if status != 503:
                    w.request_result(True, router.config)
                    return status, ctype.encode(), data
            except UpstreamError as e:
                last = e
                w.request_result(False, router.config)
                router.probe_soon(w)
            tried.append(w)
        raise NoWorkerAvailable(f"no worker answered {path}" + (f": {last}" if last else ""))

    async def _forward_one(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope["path"]
        try:
            status, ctype, data = await self._get_any(path, scope)
            if path == "/model_info" and status == 404:  # workers that only have the older name
                status, ctype, data = await self._get_any("/get_model_info", scope)
        except NoWorkerAvailable as e:
            await _respond(send, 503, _error_body(503, str(e)))
            return
        await _respond(send, status, data, ctype)

    async def _broadcast(self, method: str, path: str, body: bytes, scope: dict) -> List[Tuple[Worker, Any]]:
        """``(worker, (status, content type, body) or the UpstreamError)`` for every available worker."""
        router = self.router
        assert router.client is not None
        workers = router.available()
        headers = self._upstream_headers(scope, json_body=bool(body))

        async def one(w: Worker) -> Any:
            try:
                return await router.client.fetch(method, w.url, path, body, headers)
            except UpstreamError as e:
                return e

        results = await asyncio.gather(*(one(w) for w in workers))
        return list(zip(workers, results))

    async def _flush_cache(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = await _read_body(receive)
        results = await self._broadcast(scope["method"], "/flush_cache", body, scope)
        if not results:
            await _respond(send, 503, _error_body(503, "no worker is available"))
            return
        failed = [(w, r) for w, r in results if isinstance(r, Exception) or r[0] != 200]
        if not failed:
            if len(results) == len(self.router.workers):  # every worker starts over
                self.router.policy.forget()
            await _respond(send, 200, json.dumps({
                "success": True, "message": f"Cache flushed on {len(results)} worker(s)."}).encode())
            return
        w, r = failed[0]
        if isinstance(r, Exception):
            await _respond(send, 502, _error_body(502, f"flush_cache failed on {w.url}: {r}"))
        else:  # pass the first worker's refusal through (e.g. busy)
            await _respond(send, r[0], r[2], r[1].encode())

    async def _abort_request(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = await _read_body(receive)
        results = await self._broadcast("POST", "/abort_request", body, scope)
        ok = False
        for _, r in results:
            if isinstance(r, Exception):
                continue
            if r[0] != 200:
                await _respond(send, r[0], r[2], r[1].encode())
                return
            with contextlib.suppress(ValueError, AttributeError):
                ok = ok or bool(json.loads(r[2]).get("success"))
        await _respond(send, 200, json.dumps({"success": ok}).encode())

    async def _metrics(self, scope: dict, receive: Callable, send: Callable) -> None:
        results = await self._broadcast("GET", "/metrics", b"", scope)
        texts = [r[2].decode() for _, r in results if not isinstance(r, Exception) and r[0] == 200]
        await _respond(send, 200, render_metrics(self.router, texts).encode(),
                       b"text/plain; version=0.0.4; charset=utf-8")

    async def _workers(self, scope: dict, receive: Callable, send: Callable) -> None:
        await _respond(send, 200, json.dumps(self.router.state()).encode())
