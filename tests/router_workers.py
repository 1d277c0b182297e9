"""Real worker processes for the router's tests and benchmark (one place to change).

Each worker is ``radixserve serve`` (an API process and its engine core) whose core publishes
its cache events on ``--kv-events-endpoint``.

Usage::

    with running_workers(2, kv_cache_tokens=2048) as workers:
        urls = [w.url for w in workers]; events = [w.events for w in workers]
        workers[0].kill(); workers[0].start()  # same URL and events endpoint

"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

_TESTS = Path(__file__).resolve().parent
_SRC = _TESTS.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(port: int, events: str, worker_id: str, model: str, kv_cache_tokens: int,
                   extra: list[str]) -> list[str]:
    """``radixserve serve`` with its engine core publishing cache events on ``events``."""
    del worker_id  # the core names itself (host:pid) in its events
    return [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
            "--kv-events-endpoint", events, "--model", model, "--kv-cache-tokens", str(kv_cache_tokens),
            "--num-threads", "1", "--dtype", "float32", "--log-level", "warning", *extra]


@dataclass
class WorkerProc:
    """One worker process; ``start()`` again after ``kill()`` reuses its URL and endpoint."""

    worker_id: str
    model: str = "tiny-random"
    kv_cache_tokens: int = 4096
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def start(self) -> "WorkerProc":
        if not self.log_path:
            fd, self.log_path = tempfile.mkstemp(prefix=f"radixserve-{self.worker_id}-", suffix=".log")
            os.close(fd)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_SRC), str(_TESTS),
                                                           os.environ.get("PYTHONPATH", "")])}
        env.setdefault("OMP_NUM_THREADS", "1")
        log = open(self.log_path, "ab")
        cmd = worker_command(self.port, self.events, self.worker_id, self.model,
                             self.kv_cache_tokens, self.extra)
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.worker_id} exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.worker_id} not ready after {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL to the API process and its engine core: the worker vanishes mid-whatever,
        as a crashed machine would (and frees its ports at once)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def start_workers(n: int, **kw: Any) -> list[WorkerProc]:
    """Start ``n`` workers in parallel and wait until all answer ``/health``."""
    workers = [WorkerProc(f"w{i}", **kw).start() for i in range(n)]
    try:
        for w in workers:
            w.wait_ready()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


@contextlib.contextmanager
def running_workers(n: int, **kw: Any) -> Iterator[list[WorkerProc]]:
    workers = start_workers(n, **kw)
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


# --------------------------------------------------------------------------- the router
@dataclass
class RouterHandle:
    """A router running in this process (uvicorn on a thread with its own event loop)."""

    url: str
    router: Any
    server: Any
    thread: threading.Thread
    loop: Any = None

    def call(self, fn: Any, timeout: float = 30.0) -> Any:
        """Run ``fn(router)`` on the router's event loop (its state is not thread-safe)."""
        import asyncio

        async def run() -> Any:
            return fn(self.router)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_router(worker_urls: list[str], worker_events: list[str] | None = None,
                 **config: Any) -> RouterHandle:
    """Start a router in front of ``worker_urls`` on 127.0.0.1:<free port>, served by the
    uvicorn (as ``radixserve router`` does) on a thread of its own."""
    import asyncio

    import uvicorn

    from radixserve.router.app import RouterApp
    from radixserve.placement.config import RouterConfig
    from radixserve.router.fleet import Router

    cfg = RouterConfig(workers=tuple(worker_urls), worker_events=tuple(worker_events or ()), **config)
    router = Router(cfg)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(RouterApp(router), log_level="warning", access_log=False,
                                           lifespan="on", timeout_graceful_shutdown=5))
    holder: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except BaseException as e:  # surfaced by the readiness wait
            holder["error"] = e
        finally:
            sock.close()
            loop.close()

    thread = threading.Thread(target=run, daemon=True, name=f"router-{port}")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if "error" in holder or not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"router did not start: {holder.get('error')!r}")
        time.sleep(0.02)
    return RouterHandle(f"http://127.0.0.1:{port}", router, server, thread, holder["loop"])


@contextlib.contextmanager
def running_router(worker_urls: list[str], worker_events: list[str] | None = None,
                   **config: Any) -> Iterator[RouterHandle]:
    h = start_router(worker_urls, worker_events, **config)
    try:
        yield h
    finally:
        h.stop()


def tenant_turns(tenants: int = 8, rounds: int = 4, system: int = 40, question: int = 10) -> list:
    """Rounds of prompts (token ids): each tenant's ``system``-token prompt (one shared first
    token, as a BOS) and a ``question`` of its own per round, tenants shuffled per round."""
    rng = random.Random(0)
    systems = [[1] + [10 + t] * (system - 1) for t in range(tenants)]
    out = []
    for r in range(rounds):
        order = list(range(tenants))
        rng.shuffle(order)
        out.append([systems[t] + [200 + (tenants + 1) * r + t] * question for t in order])
    return out


def wait_for(cond: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def fetch_snapshot(events_endpoint: str, timeout: float = 10.0) -> Any:
    """A worker's snapshot, asked for on its event endpoint as a router would (the
    worker's own tree, for comparing with the router's mirror)."""
    import zmq

    from radixserve.kv_events import Snapshot, Subscribe, decode_from_worker, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(events_endpoint)
    try:
        sock.send(encode(Subscribe(resync=True)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sock.poll(100):
                msg = decode_from_worker(sock.recv())
                if isinstance(msg, Snapshot):
                    return msg
        raise TimeoutError(f"no snapshot from {events_endpoint}")
    finally:
        sock.close(0)
