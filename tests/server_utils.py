"""Start a real radixserve HTTP server (uvicorn, loopback, free port) inside the test process.

Reused by other suites (frontend language, benchmarks)::

    from server_utils import start_server

    base_url, handle = start_server(model="tiny-random", kv_cache_tokens=4096)
    try:
        ...  # httpx / openai against base_url (OpenAI API at base_url + "/v1")
    finally:
        handle.stop()

or as a context manager: ``with running_server(model="tiny-random") as (url, handle): ...``.

The server runs in a background thread with its own event loop; the engine runs on the
bridge's thread, exactly as under ``radixserve serve``. ``handle.engine`` /
``handle.bridge`` give direct access (e.g. ``handle.call(lambda e: e.check_integrity())``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from radixserve.engine.engine import Engine
from radixserve.server.app import create_app
from radixserve.server.bridge import EngineBridge

DEFAULT_TEST_MODEL = "tiny-random"


@dataclass
class ServerHandle:
    """A running server; ``stop()`` shuts uvicorn and the engine thread down."""

    base_url: str
    engine: Engine
    app: Any
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str | None = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def bridge(self) -> EngineBridge:
        return self.app.state.bridge

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def call(self, fn: Callable[[Engine], Any], timeout: float = 60.0) -> Any:
        """Run ``fn(engine)`` on the engine thread (the only safe place) and return its result."""
        return self.bridge.call_sync(fn, timeout)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no request runs or waits; returns the engine stats at that moment."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.call(lambda e: e.stats())
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
    engine: Engine | None = None,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "warning",
    startup_timeout: float = 120.0,
    **engine_kwargs: Any,
) -> tuple[str, ServerHandle]:
    """Start a server on 127.0.0.1:<free port>; returns ``(base_url, handle)``.

    ``engine_kwargs`` are EngineConfig fields (``kv_cache_tokens=4096``, ``cache="none"``...).
    Pass ``engine=`` to serve an engine you built (it must not be used elsewhere meanwhile).
    """
    if engine is None:
        if model == DEFAULT_TEST_MODEL:
            engine_kwargs.setdefault("kv_cache_tokens", 8192)
        # Tests compare greedy outputs across batch shapes: float32 keeps those bit-stable.
        engine_kwargs.setdefault("dtype", "float32")
        engine = Engine(model, **engine_kwargs)
    app = create_app(engine, api_key=api_key, served_model_name=served_model_name)
    sock = free_port_socket()
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as e:  # surfaced by the readiness wait below
            errors.append(e)
        finally:
            sock.close()

    thread = threading.Thread(target=run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    base_url = f"http://{host}:{port}"
    handle = ServerHandle(base_url, engine, app, server, thread, api_key)
    deadline = time.monotonic() + startup_timeout
    while True:
        if errors:
            raise RuntimeError(f"server failed to start: {errors[0]!r}") from errors[0]
        if server.started:
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
