"""A small HTTP/1.1 client for the router's calls to workers (keep-alive pools, streaming).

Why not httpx: the router's whole job per request is one upstream call, and on a CPU shared
with the workers its cost is throughput lost. httpx runs each call through httpcore's
pool (scanned on every request) and h11's pure-Python parser; this client reads a status
line, headers and a body with ``asyncio`` streams and nothing else
(``python benchmarks/bench_router.py --overhead N`` measures the router's added latency).
The router talks to known workers over plain HTTP/1.1 only, which keeps this small:
requests carry a ``Content-Length``; responses are read by ``Content-Length``, chunked
transfer coding, or until close.

Errors: anything that goes wrong on the wire raises :class:`UpstreamError`; a pooled
connection the worker had already closed (idle keep-alive timeout) is retried once on a
fresh connection when not a byte of the answer had come back.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

__all__ = ["UpstreamClient", "UpstreamError", "UpstreamTimeout", "UpstreamResponse"]

_LIMIT = 1 << 20  # longest status line + headers accepted


class UpstreamError(Exception):
    """The worker could not be reached, or the connection broke before the answer was whole."""


class UpstreamTimeout(UpstreamError):
    """No answer within the read timeout (the request may still be running there)."""


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Pool:
    def __init__(self, host: str, port: int, max_idle: int) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self.idle: List[_Conn] = []

    def take(self) -> Optional[_Conn]:
        while self.idle:
            c = self.idle.pop()
            if not c.reader.at_eof() and not c.writer.is_closing():
                return c
            c.close()
        return None

    def give(self, c: _Conn) -> None:
        if len(self.idle) < self.max_idle and not c.writer.is_closing():
            self.idle.append(c)
        else:
            c.close()

    def close(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()


class UpstreamResponse:
    """Status and headers are read; the body is read with :meth:`read` or :meth:`chunks`
    (exactly once). Leaving early without reading it all: call :meth:`close`."""

    def __init__(self, client: "UpstreamClient", pool: _Pool, conn: _Conn, status: int,
                 headers: Dict[str, str], head: bool, timeout: Optional[float]) -> None:
        self._client = client
        self._timeout = timeout
        self._pool = pool
        self._conn: Optional[_Conn] = conn
        self.status = status
        self.headers = headers
        self._no_body = head or status in (204, 304) or 100 <= status < 200
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        cl = headers.get("content-length")
        self._length = int(cl) if cl is not None and cl.strip().isdigit() else None
        self._keep = headers.get("connection", "").lower() != "close" and \
            (self._chunked or self._length is not None or self._no_body)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    async def _rd(self, coro):
        return await self._client._timed(coro, self._timeout)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked coding removed)."""
        conn = self._conn
        assert conn is not None, "body already consumed"
        r = conn.reader
        try:
            if self._no_body:
                pass
            elif self._chunked:
                while True:
                    line = await self._rd(r.readuntil(b"\r\n"))
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while (await self._rd(r.readuntil(b"\r\n"))) != b"\r\n":
                            pass  # trailers
                        break
                    data = await self._rd(r.readexactly(size + 2))
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left > 0:
                    data = await self._rd(r.read(min(left, 1 << 16)))
                    if not data:
                        raise UpstreamError("connection closed before the body was complete")
                    left -= len(data)
                    yield data
            else:
                while True:
                    data = await self._rd(r.read(1 << 16))
                    if not data:
                        break
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as e:
            self.close()
            raise UpstreamError(f"{type(e).__name__}: {e}") from None
        except BaseException:
            self.close()
            raise
        self._done()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def _done(self) -> None:
        if self._keep and self._conn is not None:
            conn, self._conn = self._conn, None
            self._pool.give(conn)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection (the body was not read to its end)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class UpstreamClient:
    def __init__(self, connect_timeout: float = 5.0, read_timeout: Optional[float] = None,
                 max_idle_per_host: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle_per_host
        self._pools: Dict[Tuple[str, int], _Pool] = {}

    async def _timed(self, coro, timeout: Optional[float] = -1.0):
        """``coro`` with ``timeout`` seconds (-1: the client's read timeout; None: none)."""
        t = self.read_timeout if timeout == -1.0 else timeout
        if t is None:
            return await coro
        try:
            async with asyncio.timeout(t):  # no extra task per read, unlike wait_for
                return await coro
        except TimeoutError:
            raise UpstreamTimeout(f"no answer within {t}s") from None

    def _pool(self, base_url: str) -> Tuple[_Pool, str]:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"url must be http://host:port, got {base_url!r}")
        key = (u.hostname, u.port or 80)
        if key not in self._pools:
            self._pools[key] = _Pool(key[0], key[1], self.max_idle)
        return self._pools[key], f"{u.hostname}:{u.port or 80}"

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Optional[Dict[str, str]] = None,
                      timeout: Optional[float] = -1.0) -> UpstreamResponse:
        """Send a request; returns once the status line and headers are in."""
        pool, host = self._pool(base_url)
        lines = [f"{method} {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        for attempt in (0, 1):
            conn = pool.take() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                try:
                    r, w = await self._timed(
                        asyncio.open_connection(pool.host, pool.port, limit=_LIMIT), self.connect_timeout)
                except (OSError, ConnectionError) as e:
                    raise UpstreamError(f"cannot connect to {host}: {e}") from None
                conn = _Conn(r, w)
            try:
                conn.writer.write(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    conn.writer.write(body)
                await conn.writer.drain()
                status_line = await self._timed(conn.reader.readuntil(b"\r\n"), timeout)
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                conn.close()
                if reused:
                    continue  # the worker closed an idle connection: once more, fresh
                raise UpstreamError(f"{type(e).__name__}: {e}") from None
            except BaseException:
                conn.close()
                raise
            try:
                raw = await self._timed(conn.reader.readuntil(b"\r\n\r\n"), timeout)
                parts = status_line.split(b" ", 2)
                status = int(parts[1])
                hdrs: Dict[str, str] = {}
                for ln in raw[:-4].split(b"\r\n"):
                    if b":" in ln:
                        k, v = ln.split(b":", 1)
                        hdrs[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError,
                    ValueError, IndexError) as e:
                conn.close()
                raise UpstreamError(f"bad answer from {host}: {type(e).__name__}: {e}") from None
            except BaseException:
                conn.close()
                raise
            return UpstreamResponse(self, pool, conn, status, hdrs, method == "HEAD", timeout)
        raise UpstreamError(f"cannot reach {host}")  # pragma: no cover - loop always returns

    async def fetch(self, method: str, base_url: str, path: str, body: bytes = b"",
                    headers: Optional[Dict[str, str]] = None,
                    timeout: Optional[float] = -1.0) -> Tuple[int, str, bytes]:
        """Whole answer: ``(status, content type, body)``."""
        resp = await self.request(method, base_url, path, body, headers, timeout)
        return resp.status, resp.content_type, await resp.read()

    async def aclose(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
