"""What the router knows about one worker: health, circuit breaker, load, cache mirror.

All of it lives on the router's event loop (one thread): routing, event replay and health
checks interleave between awaits, so nothing here needs a lock.

Health has two inputs. Health checks (``GET /health``) take a worker out after
``health_failures`` consecutive failures and bring it back after ``health_successes``
successes. Requests feed a circuit breaker: ``breaker_failures`` consecutive transport
failures open it for ``breaker_cooldown_s``, after which the next good health check closes it
(half-open through the probe, never through a client's request). A worker is *available*
when it is healthy and its breaker is closed.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, List, Optional, Set

from radixserve.placement.mirror import TokenTree, WorkerMirror

__all__ = ["Worker", "Ticket", "NoWorkerAvailable"]


class NoWorkerAvailable(RuntimeError):
    """Every worker is down (or excluded after failing this request)."""


@dataclass(eq=False)
class Ticket:
    """One request routed to one worker (until it ends)."""

    worker: "Worker"
    tokens: bytes
    salt: Hashable
    predicted_tokens: int  # prompt tokens the worker was predicted to compute
    cached_tokens: int  # prompt tokens it was predicted to find (mirror + in flight)
    low_priority_from: Optional[int] = None  # the policy's hint for the worker's cache
    task: Optional[asyncio.Task] = None  # the upstream call, cancelled if the worker goes down
    worker_down: bool = False
    started: float = field(default_factory=time.monotonic)


class Worker:
    def __init__(self, index: int, url: str, events: Optional[str], page_size: int = 1) -> None:
        self.index = index
        self.url = url.rstrip("/")
        self.events = events
        self.mirror: Optional[WorkerMirror] = WorkerMirror(page_size) if events else None
        #: Prompts in flight here (reference-counted): locality before the worker's events
        #: confirm them, so a burst of requests sharing a new prefix stays together.
        self.inflight = TokenTree(page_size)
        self.outstanding = 0  # requests in flight from this router
        self.queued_tokens = 0  # predicted prompt tokens still to compute for them
        self.tickets: Set[Ticket] = set()
        self._new = 0.0
        self._new_t = time.monotonic()
        self.healthy = False  # until the first good check
        self.ok_streak = self.fail_streak = self.req_fail_streak = 0
        self.breaker_open_until = 0.0
        self.routed = self.failures = self.predicted_hit_tokens = 0  # counters
        self.on_down: List[Callable[["Worker"], None]] = []
        self.on_up: List[Callable[["Worker"], None]] = []

    # ------------------------------------------------------------------ availability
    def available(self, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.healthy and now >= self.breaker_open_until

    def _set_healthy(self, ok: bool) -> None:
        if ok == self.healthy:
            return
        self.healthy = ok
        for cb in (self.on_up if ok else self.on_down):
            cb(self)

    def health_result(self, ok: bool, cfg, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        if ok:
            self.fail_streak = 0
            self.ok_streak += 1
            if self.breaker_open_until and now >= self.breaker_open_until:
                self.breaker_open_until = 0.0
                self.req_fail_streak = 0
            if not self.healthy and self.ok_streak >= cfg.health_successes:
                self._set_healthy(True)
        else:
            self.ok_streak = 0
            self.fail_streak += 1
            if self.healthy and self.fail_streak >= cfg.health_failures:
                self._set_healthy(False)

    def request_result(self, ok: bool, cfg, now: Optional[float] = None) -> None:
        """A request's transport outcome (an HTTP answer of any status counts as ok)."""
        if ok:
            self.req_fail_streak = 0
            return
        self.failures += 1
        self.req_fail_streak += 1
        if self.req_fail_streak >= cfg.breaker_failures and not self.breaker_open_until:
            now = time.monotonic() if now is None else now
            self.breaker_open_until = now + cfg.breaker_cooldown_s
            for cb in self.on_down:
                cb(self)

    # ------------------------------------------------------------------ load
    #: Time constant of the decayed count below (seconds).
    RECENT_WINDOW_S = 30.0

    def recent_new_prefixes(self, now: Optional[float] = None) -> float:
        """Requests that started a new prefix here (no worker held it), exponentially decayed
        over ``RECENT_WINDOW_S``: new prefixes are dealt out evenly by this count."""
        now = time.monotonic() if now is None else now
        return self._new * math.exp((self._new_t - now) / self.RECENT_WINDOW_S)

    def begin(self, ticket: Ticket, new_prefix: bool = False) -> None:
        now = ticket.started
        if new_prefix:
            self._new = self.recent_new_prefixes(now) + 1.0
            self._new_t = now
        self.outstanding += 1
        self.queued_tokens += ticket.predicted_tokens
        self.routed += 1
        self.predicted_hit_tokens += ticket.cached_tokens
        self.tickets.add(ticket)
        if ticket.tokens:
            self.inflight.insert(ticket.tokens, ticket.salt)

    def end(self, ticket: Ticket) -> None:
        if ticket not in self.tickets:
            return
        self.tickets.discard(ticket)
        self.outstanding -= 1
        self.queued_tokens -= ticket.predicted_tokens
        if ticket.tokens:
            self.inflight.discard(ticket.tokens, ticket.salt)

    def cancel_all(self) -> int:
        """Cancel every upstream call in flight here (the worker went down)."""
        n = 0
        for t in list(self.tickets):
            if t.task is not None and not t.task.done():
                t.worker_down = True
                t.task.cancel()
                n += 1
        return n

    def state(self) -> dict:
        m = self.mirror
        return {
            "index": self.index, "url": self.url, "events": self.events, "healthy": self.healthy,
            "available": self.available(), "breaker_open": self.breaker_open_until > time.monotonic(),
            "outstanding": self.outstanding, "queued_tokens": self.queued_tokens, "routed": self.routed,
            "failures": self.failures, "predicted_hit_tokens": self.predicted_hit_tokens,
            "mirror": None if m is None else {
                "synced": m.synced, "epoch": m.status.epoch, "seq": m.status.seq,
                "tokens": {tier: t.num_tokens for tier, t in m.trees.items()},
                "window": m.window, "states": m.states,
                "tombstoned_tokens": {tier: t.tombstoned for tier, t in m.trees.items() if t.tombstoned},
                "resyncs": m.status.resyncs, "gaps": m.status.gaps, "mismatches": m.status.mismatches,
                "load": None if m.load is None else {
                    "running": m.load.running, "waiting": m.load.waiting, "kv_free": m.load.kv_free,
                    "kv_capacity": m.load.kv_capacity, "cached": m.load.cached},
            },
        }
