"""Start a real radixserve HTTP server (uvicorn, loopback, free port) inside the test process.

Reused by other suites (frontend language, benchmarks)::

    from server_utils import start_server

    base_url, handle = start_server(model="tiny-random", kv_cache_tokens=4096)
    try:
        ...  # httpx / openai against base_url (OpenAI API at base_url + "/v1")
    finally:
        handle.stop()

or as a context manager: ``with running_server(model="tiny-random") as (url, handle): ...``.

The server runs in a background thread with its own event loop; its engine core runs on a
thread too (``core_in_process``) so tests reach the in-process ``Engine`` as
``handle.engine``. ``handle.call("stats")`` runs an engine utility through the same
channel the API uses. ``tests/test_server_process.py`` covers the core in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.server.app import create_app

DEFAULT_TEST_MODEL = "tiny-random"


@dataclass
class ServerHandle:
    """A running server; ``stop()`` shuts uvicorn and the engine core down."""

    base_url: str
    engine: Engine | None
    app: Any
    server: uvicorn.Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    api_key: str | None = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def client(self) -> Any:
        return self.app.state.client

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def call(self, method: str, timeout: float = 60.0, **args: Any) -> Any:
        """Run an engine utility ("stats", "check_integrity", "flush_cache") between steps."""
        fut = asyncio.run_coroutine_threadsafe(self.client.call(method, **args), self.loop)
        return fut.result(timeout)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def check_integrity(self) -> dict[str, Any]:
        return self.call("check_integrity")

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no request runs or waits; returns the engine stats at that moment."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["running_requests"] == 0 and stats["waiting_requests"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not idle after {timeout}s: {stats}")
            time.sleep(0.05)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening-ready socket bound to a free port (handed to uvicorn: no port race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def start_server(
    model: str | Any = DEFAULT_TEST_MODEL,
    *,
    engine: Any = None,
    api_key: str | list[str] | None = None,
    server: ServerConfig | None = None,
    log_level: str = "warning",
    startup_timeout: float = 120.0,
    **engine_kwargs: Any,
) -> tuple[str, ServerHandle]:
    """Start a server on 127.0.0.1:<free port>; returns ``(base_url, handle)``.

    ``engine_kwargs`` are EngineConfig fields (``kv_cache_tokens=4096``, ``cache="none"``...).
    Pass ``engine=`` to serve an Engine you built (not stepped elsewhere meanwhile), or an
    ``EngineConfig`` to run the core in its own process; ``server=`` for server options.
    """
    if engine is None:
        if model == DEFAULT_TEST_MODEL:
            engine_kwargs.setdefault("kv_cache_tokens", 8192)
        # Tests compare greedy outputs across batch shapes: float32 keeps those bit-stable.
        engine_kwargs.setdefault("dtype", "float32")
        engine = Engine(model, **engine_kwargs)
    if server is None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        server = ServerConfig(api_key=tuple(keys), log_level=log_level)
    app = create_app(engine, server)
    sock = free_port_socket()
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=5)
    srv = uvicorn.Server(config)
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()

    def run() -> None:
        try:
            loop.run_until_complete(srv.serve(sockets=[sock]))
        except BaseException as e:  # surfaced by the readiness wait below
            errors.append(e)
        finally:
            sock.close()

    thread = threading.Thread(target=run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    base_url = f"http://{host}:{port}"
    first_key = server.api_key[0].partition(":")[0] if server.api_key else None
    handle = ServerHandle(base_url, engine if isinstance(engine, Engine) else None, app, srv, thread,
                          loop, first_key)
    deadline = time.monotonic() + startup_timeout
    while True:
        if errors:
            raise RuntimeError(f"server failed to start: {errors[0]!r}") from errors[0]
        if srv.started:
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    return base_url, handle
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline or not thread.is_alive():
            handle.stop()
            raise RuntimeError("server did not become ready")
        time.sleep(0.02)


@contextlib.contextmanager
def running_server(model: str | Any = DEFAULT_TEST_MODEL, **kwargs: Any) -> Iterator[tuple[str, ServerHandle]]:
    """``start_server`` as a context manager that always stops the server."""
    base_url, handle = start_server(model, **kwargs)
    try:
        yield base_url, handle
    finally:
        handle.stop()
