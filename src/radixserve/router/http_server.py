"""A lean HTTP/1.1 server for the router's ASGI app (what ``radixserve router`` runs).

Why not uvicorn: without ``httptools`` uvicorn parses HTTP with h11, in pure Python, for
every request and every response; on a machine whose cores the workers need, the router's
CPU and wakeups are latency added to every request
(``python benchmarks/bench_router.py --overhead N`` measures the router's added latency). The router's clients
speak plain HTTP/1.1 JSON, so this stays small: one ``asyncio.Protocol`` per connection,
requests answered in order (pipelining allowed), bodies by ``Content-Length`` or chunked,
``Expect: 100-continue``, keep-alive by default, responses with ``Content-Length`` when
the app answers in one piece and chunked transfer coding when it streams.

Only the parts of ASGI the router uses are implemented (``http`` and ``lifespan`` scopes;
no WebSocket, no trailers). The app is any ASGI 3 callable: uvicorn can still serve it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["serve", "HTTPServer"]

logger = logging.getLogger("radixserve.router")

MAX_HEAD = 64 * 1024
MAX_BODY = 512 * 1024 * 1024
_REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
            404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
            422: "Unprocessable Entity", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}


def _error_json(status: int, message: str) -> bytes:
    return ('{"error": {"message": "%s", "type": "invalid_request_error", "param": null, "code": %d}}'
            % (message, status)).encode()


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Request:
    __slots__ = ("method", "target", "version", "headers", "body", "keep_alive", "error")

    def __init__(self, method: str, target: str, version: str, headers: List[Tuple[bytes, bytes]],
                 body: bytes, keep_alive: bool, error: int = 0) -> None:
        self.error = error  # a request that could not be parsed: answer this status, close
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


class _Connection(asyncio.Protocol):
    def __init__(self, server: "HTTPServer") -> None:
        self.server = server
        self.transport: Optional[asyncio.Transport] = None
        self.buf = bytearray()
        self.queue: List[_Request] = []
        self.busy = False
        self.closed = False
        self.closing = False  # no more requests read (error or Connection: close)
        self.disconnected = asyncio.Event()
        self.can_write: Optional[asyncio.Future] = None
        self.peer: Any = None
        self.local: Any = None
        self.task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = transport.get_extra_info("peername")
        self.local = transport.get_extra_info("sockname")
        self.server.connections.add(self)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.closed = True
        self.disconnected.set()
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)
        self.server.connections.discard(self)

    def pause_writing(self) -> None:
        if self.can_write is None or self.can_write.done():
            self.can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.buf += data
        try:
            while not self.closing:
                req = self._parse()
                if req is None:
                    break
                self.queue.append(req)
                if not req.keep_alive:
                    self.closing = True
        except _BadRequest as e:
            self.closing = True
            # Answered in turn, after the requests before it; then the connection closes.
            self.queue.append(_Request("", "", "", [], _error_json(e.status, str(e)), False, e.status))
        if len(self.queue) > 1:
            self.transport.pause_reading()  # type: ignore[union-attr]  # one request ahead is enough
        if not self.busy and self.queue:
            self._next()

    # ------------------------------------------------------------------ parsing
    def _parse(self) -> Optional[_Request]:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                raise _BadRequest(431, "request head too large")
            return None
        lines = bytes(buf[:end]).split(b"\r\n")
        while lines and not lines[0]:
            lines.pop(0)  # tolerate stray CRLFs between requests
        if not lines:
            del buf[: end + 4]
            return None
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise _BadRequest(400, "malformed request line")
        method, target, version = (p.decode("latin-1") for p in parts)
        headers: List[Tuple[bytes, bytes]] = []
        length = None
        chunked = False
        conn_hdr = b""
        expect = False
        for ln in lines[1:]:
            k, sep, v = ln.partition(b":")
            if not sep:
                raise _BadRequest(400, "malformed header line")
            k = k.strip().lower()
            v = v.strip()
            headers.append((k, v))
            if k == b"content-length":
                if not v.isdigit():
                    raise _BadRequest(400, "bad Content-Length")
                length = int(v)
            elif k == b"transfer-encoding":
                chunked = b"chunked" in v.lower()
            elif k == b"connection":
                conn_hdr = v.lower()
            elif k == b"expect" and v.lower() == b"100-continue":
                expect = True
        start = end + 4
        if chunked:
            got = self._dechunk(start)
            if got is None:
                if expect and self.transport is not None:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                return None
            body, consumed = got
        else:
            n = length or 0
            if n > MAX_BODY:
                raise _BadRequest(413, "request body too large")
            if len(buf) - start < n:
                if expect and len(buf) == start and self.transport is not None:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                return None
            body = bytes(buf[start : start + n])
            consumed = start + n
        del buf[:consumed]
        keep = (b"close" not in conn_hdr) if version == "HTTP/1.1" else (b"keep-alive" in conn_hdr)
        return _Request(method, target, version, headers, body, keep)

    def _dechunk(self, pos: int) -> Optional[Tuple[bytes, int]]:
        buf = self.buf
        out = bytearray()
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            try:
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0].strip() or b"0", 16)
            except ValueError:
                raise _BadRequest(400, "bad chunk size") from None
            pos = eol + 2
            if size == 0:
                while True:  # trailers, up to an empty line
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        return None
                    if eol == pos:
                        return bytes(out), eol + 2
                    pos = eol + 2
            if len(buf) < pos + size + 2:
                return None
            out += buf[pos : pos + size]
            if len(out) > MAX_BODY:
                raise _BadRequest(413, "request body too large")
            pos += size + 2

    # ------------------------------------------------------------------ running the app
    def _next(self) -> None:
        req = self.queue.pop(0)
        if len(self.queue) <= 1 and self.transport is not None and not self.closing:
            self.transport.resume_reading()
        self.busy = True
        self.task = asyncio.get_running_loop().create_task(self._run(req))

    async def _run(self, req: _Request) -> None:
        keep = req.keep_alive
        try:
            if req.error:  # answered in its turn
                await self._write_simple(req.error, req.body, close=True)
                return
            ok = await self._call_app(req)
            keep = keep and ok
        except Exception:
            logger.exception("request handler failed")
            keep = False
        finally:
            self.busy = False
        if self.closed:
            return
        if not keep:
            self.transport.close()  # type: ignore[union-attr]
            return
        if self.queue:
            self._next()

    async def _write_simple(self, status: int, body: bytes, close: bool) -> None:
        if self.transport is None or self.closed:
            return
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n" + ("connection: close\r\n" if close else "") + "\r\n").encode()
        self.transport.write(head + body)
        if close:
            self.transport.close()

    async def _call_app(self, req: _Request) -> bool:
        """Run the app for one request; True if the response ended cleanly."""
        path, _, query = req.target.partition("?")
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": req.version[5:], "method": req.method, "scheme": "http",
            "path": path, "raw_path": path.encode("latin-1"), "query_string": query.encode("latin-1"),
            "root_path": "", "headers": req.headers, "client": self.peer, "server": self.local,
        }
        sent_body = [False]
        state = {"started": False, "status": 200, "headers": [], "chunked": False, "done": False}

        async def receive() -> dict:
            if not sent_body[0]:
                sent_body[0] = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await self.disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            if self.closed:
                return
            t = msg["type"]
            if t == "http.response.start":
                state["status"] = msg["status"]
                state["headers"] = list(msg.get("headers", ()))
                return
            if t != "http.response.body" or state["done"]:
                return
            body = msg.get("body", b"")
            more = msg.get("more_body", False)
            out = bytearray()
            if not state["started"]:
                state["started"] = True
                hdrs = state["headers"]
                has_len = any(k.lower() == b"content-length" for k, _ in hdrs)
                status = state["status"]
                out += f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n".encode()
                for k, v in hdrs:
                    out += k + b": " + v + b"\r\n"
                if not has_len:
                    if more:
                        state["chunked"] = True
                        out += b"transfer-encoding: chunked\r\n"
                    else:
                        out += b"content-length: %d\r\n" % len(body)
                if not req.keep_alive:
                    out += b"connection: close\r\n"
                elif req.version == "HTTP/1.0":
                    out += b"connection: keep-alive\r\n"
                out += b"\r\n"
            if state["chunked"]:
                if body:
                    out += b"%x\r\n" % len(body) + body + b"\r\n"
                if not more:
                    out += b"0\r\n\r\n"
            else:
                out += body
            if not more:
                state["done"] = True
            self.transport.write(bytes(out))  # type: ignore[union-attr]
            if self.can_write is not None and not self.can_write.done():
                await self.can_write  # the client reads slower than we produce

        await self.server.app(scope, receive, send)
        if not state["done"] and not self.closed:
            if not state["started"]:
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body",
                            "body": b'{"error": {"message": "no response", "type": "server_error"}}'})
            else:
                return False  # a stream left unfinished: the connection cannot be reused
        return True


class HTTPServer:
    def __init__(self, app: Callable) -> None:
        self.app = app
        self.connections: set = set()
        self._server: Optional[asyncio.AbstractServer] = None
        self._lifespan_in: Optional[asyncio.Queue] = None
        self._lifespan_out: Optional[asyncio.Queue] = None
        self._lifespan_task: Optional[asyncio.Task] = None
        self.started = False
        self.should_exit = False

    async def _lifespan(self, kind: str) -> None:
        if self._lifespan_in is None:
            self._lifespan_in, self._lifespan_out = asyncio.Queue(), asyncio.Queue()
            scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
            self._lifespan_task = asyncio.create_task(
                self.app(scope, self._lifespan_in.get, self._lifespan_out.put))
        await self._lifespan_in.put({"type": f"lifespan.{kind}"})
        msg = await self._lifespan_out.get()
        if msg["type"].endswith(".failed"):
            raise RuntimeError(f"application {kind} failed: {msg.get('message', '')}")

    async def start(self, host: str = "127.0.0.1", port: int = 0, sock: Optional[socket.socket] = None) -> None:
        await self._lifespan("startup")
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(lambda: _Connection(self), sock=sock, backlog=2048)
        else:
            self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                    reuse_address=True, backlog=2048)
        self.started = True

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._server is not None:
            self._server.close()
            deadline = asyncio.get_running_loop().time() + grace_s
            while any(c.busy for c in self.connections) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            for c in list(self.connections):
                if c.transport is not None:
                    c.transport.close()
        if self._lifespan_task is not None:
            await self._lifespan("shutdown")
            await self._lifespan_task

    async def serve(self, host: str = "127.0.0.1", port: int = 0, sock: Optional[socket.socket] = None,
                    on_started: Optional[Callable[["HTTPServer"], None]] = None) -> None:
        """Start, run until ``should_exit`` (or SIGINT/SIGTERM in the main thread), stop."""
        await self.start(host, port, sock)
        if on_started is not None:
            on_started(self)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # not the main thread: should_exit is polled instead
        while not stop.is_set() and not self.should_exit:
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        await self.stop()


def serve(app: Callable, host: str = "127.0.0.1", port: int = 0) -> None:
    """Run ``app`` until SIGINT/SIGTERM (blocking)."""
    def started(s: HTTPServer) -> None:
        logger.info("router listening on http://%s:%d", host, s.port)
        print(f"radixserve router: listening on http://{host}:{s.port}", flush=True)

    asyncio.run(HTTPServer(app).serve(host, port, on_started=started))
