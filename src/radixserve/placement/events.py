"""Router side of the event stream: one DEALER per worker feeding that worker's mirror.

The subscriber connects to the worker's :class:`~radixserve.kv_events.KVEventPublisher`,
says :class:`~radixserve.kv_events.Subscribe` (on connect, then every ``keepalive_s`` so a
restarted worker learns about it again), and applies what comes back to the worker's
:class:`~radixserve.placement.mirror.WorkerMirror`. Whenever the mirror is stale (not yet
synced, a sequence or epoch break, an event that does not fit, silence longer than
``stale_s``) it asks for a snapshot again, at most once per ``resync_retry_s``.

Runs on the router's event loop, like routing: no locks between replay and ``match``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Optional

import msgspec
import zmq
import zmq.asyncio

from radixserve.kv_events import Subscribe, decode_from_worker, encode
from radixserve.placement.worker import Worker

__all__ = ["EventSubscriber"]

logger = logging.getLogger("radixserve.router")


class EventSubscriber:
    def __init__(self, worker: Worker, ctx: zmq.asyncio.Context, *, keepalive_s: float = 1.0,
                 stale_s: float = 5.0, resync_retry_s: float = 0.25) -> None:
        if worker.mirror is None or not worker.events:
            raise ValueError(f"worker {worker.url} has no events endpoint")
        self.worker = worker
        self.mirror = worker.mirror
        self.ctx = ctx
        self.keepalive_s = keepalive_s
        self.stale_s = stale_s
        self.resync_retry_s = resync_retry_s
        self.sock: Optional[zmq.asyncio.Socket] = None
        self._last_sent = 0.0
        self._last_resync = 0.0
        self._task: Optional[asyncio.Task] = None
        self._timer: Optional[asyncio.Task] = None

    def start(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDHWM, 16)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a worker that is not there
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(self.worker.events)  # type: ignore[arg-type]
        self.sock = sock
        self._task = asyncio.create_task(self._read(), name=f"events-{self.worker.index}")
        self._timer = asyncio.create_task(self._maintain(), name=f"events-timer-{self.worker.index}")

    async def stop(self) -> None:
        for t in (self._task, self._timer):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._task = self._timer = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def request_resync(self) -> None:
        """Ask for a snapshot now (e.g. the worker came back after being down)."""
        self._last_resync = 0.0
        self._send(resync=True, now=time.monotonic())

    def _send(self, resync: bool, now: float) -> None:
        if self.sock is None:
            return
        fut = self.sock.send(encode(Subscribe(resync=resync)), zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            return  # not connected (zmq.Again): the next keepalive tries again
        self._last_sent = now
        if resync:
            self._last_resync = now

    async def _read(self) -> None:
        """Apply messages as they come (one wakeup per message burst, no polling)."""
        sock = self.sock
        assert sock is not None
        while True:
            try:
                data = await sock.recv()
                now = time.monotonic()
                self._handle(data, now)
                while True:  # whatever else is already here
                    try:
                        data = await sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(data, now)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad message end the subscription
                logger.exception("event subscriber of %s failed; continuing", self.worker.url)
                await asyncio.sleep(0.1)

    async def _maintain(self) -> None:
        """Subscribe, keep the subscription alive, and resync a stale mirror."""
        self._send(resync=True, now=time.monotonic())
        tick = min(self.keepalive_s, self.resync_retry_s) / 2
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            m = self.mirror
            if m.synced and now - m.status.last_message > self.stale_s:
                logger.warning("worker %s: no cache events for %.1fs; mirror stale",
                               self.worker.url, now - m.status.last_message)
                m.invalidate()
            if not m.synced and now - self._last_resync >= self.resync_retry_s:
                self._send(resync=True, now=now)
            elif now - self._last_sent >= self.keepalive_s:
                self._send(resync=False, now=now)

    def _handle(self, data: bytes, now: float) -> None:
        try:
            msg = decode_from_worker(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if self.mirror.apply_message(msg, now):
            logger.info("worker %s: mirror needs a snapshot (gaps=%d mismatches=%d)", self.worker.url,
                        self.mirror.status.gaps, self.mirror.status.mismatches)
            self._send(resync=True, now=now)
