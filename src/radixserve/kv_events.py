"""Worker side of the router's meta-tree: the engine's cache events, one message per step.

A data-parallel router keeps, per worker, an exact mirror of what that worker's radix tree
holds (:mod:`radixserve.placement.mirror`). This module sends it the material: every
:class:`~radixserve.cache.events.CacheEvent` the tree emits, buffered during a step and sent
as one ZMQ message when the step ends, with a per-message sequence number, plus a small load
record (running, waiting, free KV) so the router knows queue depths without polling.

Why one ROUTER socket (the worker binds, each router connects a DEALER) instead of PUB/SUB:
the snapshot a router asks for when it (re)connects travels on the same ordered connection
as the live batches, so "the snapshot is consistent with sequence number s and the next
batch is s + 1" holds by construction; PUB/SUB would need a second socket and loses the
first messages after a subscription (the slow-joiner problem). A subscriber the worker has
not heard from in ``subscriber_ttl_s`` is dropped; sends never block the engine (a full
pipe drops the message, the sequence gap makes the router resynchronise).

Threading: the tree is not thread-safe, so everything here runs on the engine's thread.
The engine loop calls :meth:`KVEventPublisher.poll` once per iteration (after each step,
and at least every ~100 ms while idle: block on the loop's own input with a timeout, or
register :attr:`KVEventPublisher.socket` in the loop's ``zmq.Poller``).

Wire format: msgspec msgpack, see :class:`Batch`, :class:`Snapshot`, :class:`Subscribe`.
Tokens stay packed ``uint32`` (the tree's own key bytes); salts are strings or None.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Union

import msgspec
import zmq

from radixserve.cache.events import CacheEvent

__all__ = ["PROTOCOL_VERSION", "WireEvent", "Load", "Batch", "Snapshot", "Subscribe", "KVEventPublisher", "load_of",
           "encode", "decode_from_worker", "decode_from_router"]

PROTOCOL_VERSION = 1


class WireEvent(msgspec.Struct, array_like=True, frozen=True):
    """A :class:`CacheEvent` on the wire (same fields, same order: a CacheEvent encodes as one)."""

    kind: str
    salt: Optional[str]
    tokens: bytes
    length: int
    tier: str = "L1"


class Load(msgspec.Struct, array_like=True, frozen=True):
    """Queue depth and memory of a worker at the end of a step."""

    running: int
    waiting: int
    kv_free: int
    kv_capacity: int
    cached: int = 0  # tokens held by the tree


class Batch(msgspec.Struct, array_like=True, tag="batch"):
    """Events of one step (maybe none: then it is a load record or a heartbeat)."""

    worker_id: str
    epoch: int  # random per publisher: a changed epoch means the worker restarted
    seq: int  # 1, 2, ... per publisher; every batch to every subscriber takes the next one
    page_size: int
    ts: float
    events: list[WireEvent]
    load: Optional[Load] = None
    window: int = 0  # a hybrid model's sliding window (tombstone events need it), else 0
    #: A hybrid Mamba model's tree: a prefix is served only up to its deepest state snapshot
    #: (``state_stored`` / ``state_dropped`` events say where they are).
    states: bool = False


class Snapshot(msgspec.Struct, array_like=True, tag="snapshot"):
    """The whole tree as ``stored`` events (parents first), consistent with batch ``seq``:
    a mirror rebuilt from it applies batches ``seq + 1, seq + 2, ...``."""

    worker_id: str
    epoch: int
    seq: int
    page_size: int
    ts: float
    events: list[WireEvent]
    load: Optional[Load] = None
    window: int = 0
    states: bool = False


class Subscribe(msgspec.Struct, array_like=True, tag="subscribe"):
    """Router -> worker. Sent on connect and as a keepalive; a subscriber the worker does
    not know yet, or one that sets ``resync``, gets a :class:`Snapshot` before any batch."""

    resync: bool = False
    version: int = PROTOCOL_VERSION


_encoder = msgspec.msgpack.Encoder()
_from_worker = msgspec.msgpack.Decoder(Union[Batch, Snapshot])
_from_router = msgspec.msgpack.Decoder(Subscribe)


def encode(msg: Union[Batch, Snapshot, Subscribe]) -> bytes:
    return _encoder.encode(msg)


def decode_from_worker(data: bytes) -> Union[Batch, Snapshot]:
    return _from_worker.decode(data)


def decode_from_router(data: bytes) -> Subscribe:
    return _from_router.decode(data)


def load_of(engine: Any) -> Load:
    """The load record of an Engine, read cheaply from its scheduler and allocator
    (``Engine.stats()`` does more work than a per-step record needs)."""
    sched = engine.scheduler
    running = len(sched.running) + (1 if getattr(sched, "chunked", None) is not None else 0)
    alloc = engine.allocator
    return Load(running, len(sched.waiting), int(alloc.available), int(alloc.capacity),
                int(engine.cache.total_size))


def _wire_event(event: CacheEvent) -> CacheEvent:
    """``event`` with its salt as the wire carries it (a string or None)."""
    return event if event.salt is None or type(event.salt) is str else event._replace(salt=str(event.salt))


class KVEventPublisher:
    """Buffers cache events and sends them, once per engine step, to every subscribed router.

    ``window``: the sliding window of a hybrid model's tree (its tombstone events mean
    nothing to a mirror without it), 0 for any other tree. ``states``: the tree is a hybrid
    Mamba model's, which serves a prefix only up to its deepest state snapshot.

    >>> pub = KVEventPublisher("tcp://127.0.0.1:5557", "worker-0", page_size=1)  # doctest: +SKIP
    >>> engine.cache.listener = pub.publish                                          # doctest: +SKIP
    >>> # engine loop, after each step and periodically while idle:
    >>> pub.poll(engine.cache, load_of(engine))                                      # doctest: +SKIP

    ``endpoint`` is bound (``tcp://host:0`` picks a free port; :attr:`endpoint` is then the
    bound address). ``heartbeat_s``: an empty batch is sent at least this often while
    ``poll``/``flush`` is called, so a router notices a lost last message or a stuck worker.
    ``load_interval_s``: a step with no events sends its changed load record only if the
    last message is older than this (decode steps change the free KV every step; a message
    per step would wake the router that often for nothing it routes by)."""

    def __init__(self, endpoint: str, worker_id: str, page_size: int = 1, *, window: int = 0, states: bool = False,
                 heartbeat_s: float = 0.5, load_interval_s: float = 0.02, subscriber_ttl_s: float = 10.0,
                 hwm: int = 100_000, context: Optional[zmq.Context] = None) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint must be a ZMQ address like tcp://127.0.0.1:5557, got {endpoint!r}")
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0 or window == 1:
            raise ValueError(f"window must be 0 (no sliding window) or an int >= 2, got {window!r}")
        if not isinstance(states, bool):
            raise ValueError(f"states must be a bool, got {states!r}")
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s!r}")
        self.worker_id = worker_id
        self.page_size = page_size
        self.window = window
        self.states = states
        self.heartbeat_s = float(heartbeat_s)
        self.load_interval_s = float(load_interval_s)
        self.subscriber_ttl_s = float(subscriber_ttl_s)
        self.epoch = int.from_bytes(os.urandom(7), "little")
        self.seq = 0
        self._buf: list = []
        self._last_load: Optional[Load] = None
        self._last_send = 0.0
        self._subs: dict[bytes, float] = {}  # DEALER identity -> last time heard from
        self._ctx = context or zmq.Context.instance()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*"):
            host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
            port = sock.bind_to_random_port(f"tcp://{host}")
            endpoint = f"tcp://{host}:{port}"
        else:
            sock.bind(endpoint)
        self.socket = sock
        self.endpoint = endpoint

    # ------------------------------------------------------------------ engine thread API
    def publish(self, event: CacheEvent) -> None:
        """The cache listener: buffer one event until the next :meth:`flush`."""
        self._buf.append(_wire_event(event))

    def flush(self, load: Optional[Load] = None, now: Optional[float] = None) -> bool:
        """Send the buffered events (and ``load``) as one message; True if one was sent. Without
        events, nothing is sent unless the load changed and the last message is older than
        ``load_interval_s``, or the last message is older than ``heartbeat_s``."""
        now = time.monotonic() if now is None else now
        if not self._buf:
            age = now - self._last_send
            if age < self.heartbeat_s and (
                    load is None or load == self._last_load or age < self.load_interval_s):
                return False
        events, self._buf = self._buf, []
        if load is not None:
            self._last_load = load
        self._last_send = now
        if not self._subs:
            return False  # nobody to tell; a subscriber gets a snapshot when it arrives
        self.seq += 1
        data = encode(Batch(self.worker_id, self.epoch, self.seq, self.page_size, time.time(),
                            events, self._last_load, self.window, self.states))  # type: ignore[arg-type]
        for ident in self._subs:
            self._send(ident, data)
        return True

    def serve_snapshots(self, cache: Any, load: Optional[Load] = None) -> int:
        """Read subscription messages without blocking; answer each new or resyncing
        subscriber with a snapshot of ``cache``. Returns how many snapshots were sent."""
        now = time.monotonic()
        want: list[bytes] = []
        seen: dict[bytes, float] = {}
        while True:
            try:
                ident, payload = self.socket.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                break
            except ValueError:
                continue  # a malformed frame list
            try:
                msg = decode_from_router(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not one of ours; ignore rather than crash the engine loop
            if (ident not in self._subs or msg.resync) and ident not in want:
                want.append(ident)
            seen[ident] = now
        if self.subscriber_ttl_s > 0:
            for ident, last in list(self._subs.items()):
                if now - last > self.subscriber_ttl_s and ident not in seen:
                    del self._subs[ident]
        if want and self._buf:
            # Send what is buffered first, to the subscribers already following the stream
            # (not to new ones): the snapshot then reflects exactly the batches up to seq.
            self.flush(load, now)
        self._subs.update(seen)
        if not want:
            return 0
        if load is not None:
            self._last_load = load
        data = encode(Snapshot(self.worker_id, self.epoch, self.seq, self.page_size, time.time(),
                               [_wire_event(ev) for ev in cache.snapshot_events()], self._last_load, self.window,
                               self.states))
        for ident in want:
            self._send(ident, data)
        return len(want)

    def poll(self, cache: Any, load: Optional[Load] = None) -> None:
        """What the engine loop calls once per iteration: flush, then answer subscribers."""
        self.flush(load)
        self.serve_snapshots(cache, load)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def close(self) -> None:
        self.socket.close(0)

    # ------------------------------------------------------------------ internals
    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            self.socket.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.Again:
            pass  # pipe full or peer gone: the router sees a sequence gap and resyncs
