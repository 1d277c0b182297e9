"""Liveness between the ranks: one TCP connection from every worker to rank 0.

Why a connection of our own and not only the collectives: rank 0 spends most of an idle
server's life outside any collective, and NCCL does not notice a dead peer at all until
its timeout. A process that dies — killed, crashed, out of memory — has its sockets closed
by the kernel, so the other end reads EOF at once, whatever either process is doing; a
process that hangs (stopped, deadlocked, cut off by the network) stops sending the
heartbeats both sides send every ``HEARTBEAT_S``, and is declared lost after
``SILENCE_LIMIT_S``. Rank 0 also polls the worker processes it started itself, which
gives the exact cause (exit status, signal).

The connection carries newline-delimited JSON: a worker says ``hello`` (rank, pid, host and
the options that must match rank 0's), ``ready`` once its shard is built (with a fingerprint
of the weights it loaded), ``err`` with the reason when it fails, and ``hb``; rank 0 sends
``hb`` and, on a clean shutdown, ``bye``.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("radixserve.parallel")

HEARTBEAT_S = 0.5
SILENCE_LIMIT_S = 15.0


def exit_description(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class _Peer:
    rank: int
    sock: socket.socket
    pid: int = 0
    host: str = ""
    hello: dict[str, Any] = field(default_factory=dict)
    ready: dict[str, Any] | None = None
    error: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    buf: bytes = b""


class LeaderWatch:
    """Rank 0's side: accepts one connection per worker, reports the first failure once
    through ``on_failure(reason)`` (called on the watch thread)."""

    def __init__(self, bind_host: str, advertise_host: str, world_size: int,
                 on_failure: Callable[[str], None]):
        self.world_size = world_size
        self.on_failure = on_failure
        self._listener = socket.create_server((bind_host, 0))
        self._listener.setblocking(False)
        self.address = f"{advertise_host}:{self._listener.getsockname()[1]}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, bytes] = {}  # connected, no hello yet
        self.peers: dict[int, _Peer] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.failure: str | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._stop = threading.Event()
        self._hostname = socket.gethostname()
        self._thread = threading.Thread(target=self._run, name="radixserve-tp-watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    def add_process(self, rank: int, proc: subprocess.Popen) -> None:
        """A worker this process started (polled for its exit status)."""
        with self._cond:
            self.procs[rank] = proc

    def describe(self, rank: int) -> str:
        p = self.peers.get(rank)
        proc = self.procs.get(rank)
        pid = p.pid if p is not None and p.pid else (proc.pid if proc is not None else None)
        where = f" on {p.host}" if p is not None and p.host and p.host != self._hostname else ""
        return f"TP rank {rank}" + (f" (pid {pid}{where})" if pid else "")

    def wait_for(self, what: str, timeout: float, check: Callable[[], None] | None = None) -> dict[int, _Peer]:
        """Block until every worker said ``what`` ("hello" or "ready"); raises ``TPFailure``
        on the first failure or after ``timeout`` seconds."""
        from radixserve.parallel.comm import TPFailure

        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.failure is not None:
                    raise TPFailure(self.failure)
                have = {r for r, p in self.peers.items()
                        if (p.hello if what == "hello" else p.ready is not None)}
                missing = [r for r in range(1, self.world_size) if r not in have]
                if not missing:
                    return dict(self.peers)
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(str(r) for r in missing)
                    verb = "connect to rank 0" if what == "hello" else "load its shard"
                    raise TPFailure(f"TP rank(s) {names} did not {verb} within {timeout:.0f}s")
                self._cond.wait(min(left, 0.2))

    def close(self, bye: bool = True) -> None:
        """Stop watching. ``bye``: a clean shutdown, said first so that workers do not take
        the EOF for a failure; without it (a failed startup or group) the bare EOF tells
        every worker, wherever it waits, to exit at once."""
        with self._cond:
            self._closing = True
            peers = list(self.peers.values())
        for p in peers if bye else ():
            try:
                p.sock.sendall(b'{"t":"bye"}\n')
            except OSError:
                pass
        self._stop.set()
        self._thread.join(5)
        for p in peers:
            p.sock.close()
        for s in self._pending:
            s.close()
        self._listener.close()
        self._sel.close()

    # ------------------------------------------------------------------ watch thread
    def fail(self, reason: str) -> None:
        """Record a failure (seen here, or elsewhere: a collective that broke) and report it,
        unless one is known."""
        with self._cond:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
            self._cond.notify_all()
        self.on_failure(reason)

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                events = self._sel.select(timeout=0.1)
            except OSError:
                return
            for key, _ in events:
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                self._beat(now)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending[conn] = b""
        self._sel.register(conn, selectors.EVENT_READ, None)

    def _peer_of(self, sock: socket.socket) -> _Peer | None:
        return next((p for p in self.peers.values() if p.sock is sock), None)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        peer = self._peer_of(sock)
        if not data:
            self._sel.unregister(sock)
            if peer is None:
                self._pending.pop(sock, None)
                sock.close()
                return
            self._lost(peer, "closed its connection to rank 0")
            return
        if peer is None:
            buf = self._pending[sock] + data
            if b"\n" not in buf:
                self._pending[sock] = buf
                return
            line, rest = buf.split(b"\n", 1)
            del self._pending[sock]
            try:
                msg = json.loads(line)
                rank = int(msg["rank"])
                if msg.get("t") != "hello" or not 0 < rank < self.world_size or rank in self.peers:
                    raise ValueError(f"unexpected hello {msg!r}")
            except (ValueError, KeyError, TypeError) as e:
                log.warning("dropping a bad tensor-parallel watch connection: %s", e)
                self._sel.unregister(sock)
                sock.close()
                return
            peer = _Peer(rank, sock, int(msg.get("pid", 0)), str(msg.get("host", "")), msg)
            with self._cond:
                self.peers[rank] = peer
                self._cond.notify_all()
            data = rest
        peer.last_seen = time.monotonic()
        self._feed(peer, data)

    def _feed(self, peer: _Peer, data: bytes) -> None:
        """Handle the complete lines of ``peer.buf + data``; keep the partial last one."""
        *lines, peer.buf = (peer.buf + data).split(b"\n")
        for line in lines:
            if line:
                self._message(peer, line)

    def _message(self, peer: _Peer, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        kind = msg.get("t")
        if kind == "ready":
            with self._cond:
                peer.ready = msg
                self._cond.notify_all()
        elif kind == "err":
            peer.error = str(msg.get("error", "unknown error"))

    def _lost(self, peer: _Peer, what: str) -> None:
        proc = self.procs.get(peer.rank)
        if proc is not None:
            try:
                proc.wait(1.0)  # a dying process closes its socket just before it is reaped
            except subprocess.TimeoutExpired:
                pass
            if proc.returncode is not None:
                what = exit_description(proc.returncode)
        self.fail(f"{self.describe(peer.rank)} {what}" + (f": {peer.error}" if peer.error else ""))

    def _beat(self, now: float) -> None:
        for p in list(self.peers.values()):
            try:
                p.sock.send(b'{"t":"hb"}\n')
            except OSError:
                pass  # a full buffer, or a closed connection (its EOF arrives through _read)
            if now - p.last_seen > SILENCE_LIMIT_S:
                self.fail(f"{self.describe(p.rank)} sent no heartbeat for {SILENCE_LIMIT_S:.0f}s "
                             "(hung or cut off)")
        for rank, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            peer = self.peers.get(rank)
            if peer is not None:
                # Read what it said before dying (its error) before reporting.
                self._drain(peer)
                self._lost(peer, exit_description(code))
            else:
                self.fail(f"{self.describe(rank)} {exit_description(code)} before it connected "
                             "to rank 0 (see its log above)")

    def _drain(self, peer: _Peer) -> None:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                data = peer.sock.recv(65536)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            except OSError:
                return
            if not data:
                return
            self._feed(peer, data)


class WorkerWatch:
    """A worker's side: connects to rank 0, says hello, then heartbeats; exits the process
    (``os._exit``) when rank 0 is gone without saying bye."""

    def __init__(self, address: str, hello: dict[str, Any], leader_pid: int | None,
                 connect_timeout: float):
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.rank = hello["rank"]
        self.leader_pid = leader_pid
        self._lock = threading.Lock()
        self.bye = False
        self.send({"t": "hello", **hello})
        self._thread = threading.Thread(target=self._run, name="radixserve-tp-watch", daemon=True)
        self._thread.start()

    def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass  # rank 0 is gone: the watch thread exits the process

    def _gone(self, why: str) -> None:
        log.error("rank 0 %s; TP rank %d exits", why, self.rank)
        logging.shutdown()
        os._exit(1)

    def _run(self) -> None:
        last_seen = time.monotonic()
        next_beat = 0.0
        buf = b""
        self.sock.settimeout(0.1)
        while True:
            try:
                data = self.sock.recv(65536)
                if not data:
                    if self.bye:
                        return  # the main thread has the shutdown message
                    self._gone("closed its connection (it exited or was killed)")
                last_seen = time.monotonic()
                buf += data
                if b'"bye"' in buf:
                    self.bye = True
                buf = buf[buf.rfind(b"\n") + 1 :]
            except TimeoutError:
                pass
            except OSError:
                if not self.bye:
                    self._gone("is unreachable")
                return
            now = time.monotonic()
            if not self.bye and now - last_seen > SILENCE_LIMIT_S:
                self._gone(f"sent no heartbeat for {SILENCE_LIMIT_S:.0f}s")
            if self.leader_pid is not None and os.getppid() != self.leader_pid and not self.bye:
                self._gone("(this worker's parent) is gone")
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                self.send({"t": "hb"})
