"""Real worker processes for the router's tests and benchmark (one place to change).

Each worker is a separate Python process serving one tiny-random (or other) Engine over
HTTP with today's ``radixserve.server.app.create_app`` + uvicorn, and publishing its cache
events with :class:`radixserve.kv_events.KVEventPublisher`. Once the engine core takes
``--kv-events-endpoint``, :func:`worker_command` becomes one line::

    [sys.executable, "-m", "radixserve", "serve", "--model", model, "--port", str(port),
     "--kv-events-endpoint", events, "--kv-cache-tokens", str(kv), ...]

Usage::

    with running_workers(2, kv_cache_tokens=2048) as workers:
        urls = [w.url for w in workers]; events = [w.events for w in workers]
        workers[0].kill(); workers[0].start()  # same URL and events endpoint

Run as a script (``python tests/router_workers.py --port P --events tcp://...``) it *is*
the worker.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    """The command line that starts one worker (the one line to switch to ``radixserve serve``)."""
    return [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--events", events,
            "--worker-id", worker_id, "--model", model, "--kv-cache-tokens", str(kv_cache_tokens),
            *extra]


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
        """SIGKILL: the worker vanishes mid-whatever, as a crashed machine would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
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
    router's own HTTP server (as ``radixserve router`` does) on a thread of its own."""
    import asyncio

    from radixserve.router.app import RouterApp
    from radixserve.router.config import RouterConfig
    from radixserve.router.core import Router
    from radixserve.router.http_server import HTTPServer

    cfg = RouterConfig(workers=tuple(worker_urls), worker_events=tuple(worker_events or ()), **config)
    router = Router(cfg)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = HTTPServer(RouterApp(router))
    holder: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        try:
            loop.run_until_complete(server.serve(sock=sock))
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


# --------------------------------------------------------------------------- the worker
def _serve(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="a radixserve worker that publishes its cache events")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--worker-id", default="w0")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--kv-cache-tokens", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--no-router-endpoints", dest="router_endpoints", action="store_false",
                   help="serve only what radixserve.server.app serves (no /model_info, /get_load)")
    args = p.parse_args(argv)

    import uvicorn

    from radixserve.engine.engine import Engine
    from radixserve.kv_events import KVEventPublisher, load_of
    from radixserve.server.app import create_app

    engine = Engine(args.model, kv_cache_tokens=args.kv_cache_tokens, page_size=args.page_size,
                    dtype=args.dtype, num_threads=args.num_threads)
    pub = KVEventPublisher(args.events, args.worker_id, page_size=engine.config.page_size)
    engine.cache.listener = pub.publish
    step = engine.step

    def step_and_publish() -> list:
        outs = step()
        pub.poll(engine.cache, load_of(engine))
        return outs

    engine.step = step_and_publish  # type: ignore[method-assign]
    app = create_app(engine)
    if args.router_endpoints:
        from radixserve.router.worker_endpoints import install_router_endpoints

        install_router_endpoints(app)
    bridge = app.state.bridge

    def tick() -> None:
        # The bridge blocks while idle: wake it so subscriptions are answered and
        # heartbeats go out (the engine core's loop will poll with a timeout instead).
        while True:
            time.sleep(0.05)
            if bridge.running:
                try:
                    bridge.run_in_engine(lambda e: pub.poll(e.cache, load_of(e)))
                except RuntimeError:
                    pass

    threading.Thread(target=tick, daemon=True, name="kv-events-tick").start()
    uvicorn.run(app, host="127.0.0.1", port=args.port,
                log_level="info" if args.access_log else "warning",
                access_log=args.access_log)


if __name__ == "__main__":
    _serve(sys.argv[1:])
