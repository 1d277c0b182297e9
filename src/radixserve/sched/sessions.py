"""Session-aware retention: a conversation's cached tokens stay servable between its turns.

A request may carry a session id (SGLang's ``session_params.id``, the ``X-Session-Id``
header, ``Engine.generate(..., session_id=)``). When it finishes normally, the scheduler
hands the tokens it cached to :meth:`SessionTable.retain`, which takes one lock on the tree
node at their cached end and keeps it for the session, releasing the session's previous lock.
For a hybrid model (:class:`~radixserve.cache.swa.SWARadixCache`) that lock protects the
full KV of the conversation's root path and the sliding-window KV of its last ``W - 1``
tokens: exactly what the next turn's match needs, and what SWA pressure from other traffic
would otherwise tombstone between turns. For a plain radix cache it keeps the whole
conversation's KV. Without a cache (or when nothing was cached) a session holds nothing.

A session's lock goes, and nothing else ever takes it:

* when the session's next request finishes (the lock moves to the longer conversation);
* after ``ttl_s`` seconds without a request of the session (:meth:`expire`, once per
  scheduling step; a session opened with its own ``timeout`` uses that);
* on :meth:`close` (``/close_session``);
* for the least recently used session when a new one would exceed ``max_sessions``;
* under memory pressure (:meth:`shed_one`): retained sessions yield to requests that run.
  When eviction cannot free the slots an allocation needs (a running request's next token,
  an admitted prompt chunk), the scheduler releases the least recently used session's lock
  and evicts again, before it would retract or fail a request. Admission beside running
  requests does not shed: a request that does not fit waits for them, as it would without
  sessions;
* on :meth:`release_all` (``flush_cache``): the sessions stay open, holding nothing.

Aborted and failed requests change nothing: the session keeps the lock of its last
finished turn (still a prefix of what the client will send again). ``ttl_s == 0`` turns
sessions off: ids are accepted and ignored.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

from radixserve.cache import PrefixCache
from radixserve.cache.base import CacheHandle, TokenIds

__all__ = ["MAX_SESSION_ID_CHARS", "SessionTable", "check_session_id"]

#: Longest session id accepted (as for cache salts).
MAX_SESSION_ID_CHARS = 256


def check_session_id(value: Any, field: str = "session_id") -> str | None:
    """``value`` if it is None or a valid session id, else ValueError naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_ID_CHARS or not value.isprintable():
        shown = value if not isinstance(value, str) else value[:40]
        raise ValueError(f"{field} must be a non-empty printable string of at most {MAX_SESSION_ID_CHARS} "
                         f"characters, got {shown!r}")
    return value


def check_ttl(value: Any, field: str = "timeout") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= 1e6:
        raise ValueError(f"{field} must be a number of seconds in (0, 1e6], got {value!r}")
    return float(value)


@dataclass
class _Session:
    node: CacheHandle | None = None  # the locked cache handle, or None (holds nothing)
    tokens: int = 0  # cached tokens the lock keeps servable
    ttl_s: float | None = None  # its own TTL (open_session's timeout), else the table's
    deadline: float = math.inf


class SessionTable:
    """Open sessions and the one cache lock each may hold (see the module docstring).

    The scheduler owns it and calls it on its own thread only. ``clock`` is injectable for
    tests (``time.monotonic`` by default)."""

    def __init__(self, cache: PrefixCache, ttl_s: float, max_sessions: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.ttl_s = float(ttl_s)
        self.max_sessions = int(max_sessions)
        self.clock = clock
        #: Least recently used first.
        self._sessions: "OrderedDict[str, _Session]" = OrderedDict()
        #: (deadline, session id) per refresh; entries a later refresh or a close made stale
        #: are skipped when they come up (and dropped when they outnumber the sessions).
        self._deadlines: list[tuple[float, str]] = []
        self._holding = 0  # sessions with a lock
        self.retained = 0  # turns whose cached end a session took over
        self.expired = 0
        self.closed = 0
        self.evicted = 0  # over max_sessions
        self.shed = 0  # released under memory pressure

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    # ------------------------------------------------------------------ lifecycle
    def _refresh(self, session_id: str, s: _Session) -> None:
        s.deadline = self.clock() + (s.ttl_s if s.ttl_s is not None else self.ttl_s)
        self._sessions.move_to_end(session_id)
        heap = self._deadlines
        heapq.heappush(heap, (s.deadline, session_id))
        if len(heap) > 4 * len(self._sessions) + 64:
            heap[:] = [(x.deadline, sid) for sid, x in self._sessions.items()]
            heapq.heapify(heap)

    def _new(self, session_id: str, ttl_s: float | None = None) -> _Session:
        while len(self._sessions) >= self.max_sessions:
            _, old = self._sessions.popitem(last=False)
            self._unlock(old)
            self.evicted += 1
        s = self._sessions[session_id] = _Session(ttl_s=ttl_s)
        self._refresh(session_id, s)
        return s

    def open(self, session_id: str, ttl_s: float | None = None) -> bool:
        """Open a session explicitly (``/open_session``); False if it is open already.
        Requests open their session implicitly, so this is only needed for a TTL of its own."""
        if not self.enabled:
            raise ValueError("sessions are off on this engine (session_ttl_s = 0)")
        check_session_id(session_id)
        ttl_s = check_ttl(ttl_s)
        if session_id in self._sessions:
            return False
        self._new(session_id, ttl_s)
        return True

    def touch(self, session_id: str | None) -> None:
        """A request of the session arrived: its TTL starts again."""
        s = self._sessions.get(session_id) if session_id is not None else None
        if s is not None:
            self._refresh(session_id, s)

    def retain(self, session_id: str, key: TokenIds, salt: Hashable = None) -> int:
        """A request of the session finished with ``key`` (its tokens with KV) inserted:
        lock the node at their cached end for the session, release its previous lock.
        Returns the tokens the session now keeps."""
        if not self.enabled:
            return 0
        s = self._sessions.get(session_id)
        if s is None:
            s = self._new(session_id)
        else:
            self._refresh(session_id, s)
        m = self.cache.match_prefix(key, salt=salt)
        if m.length == 0:
            return s.tokens  # nothing of this turn is cached: keep what the last one left
        self.cache.lock(m.node)  # before the unlock: a shared path is never released between
        self._unlock(s)
        s.node, s.tokens = m.node, m.length
        self._holding += 1
        self.retained += 1
        return s.tokens

    def close(self, session_id: str) -> bool:
        """End a session now (``/close_session``); False if it is not open."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        self._unlock(s)
        self.closed += 1
        return True

    def expire(self) -> int:
        """End the sessions whose TTL has passed (cheap when none has: one comparison)."""
        heap = self._deadlines
        if not heap:
            return 0
        now = self.clock()
        n = 0
        while heap and heap[0][0] <= now:
            deadline, sid = heapq.heappop(heap)
            s = self._sessions.get(sid)
            if s is not None and s.deadline == deadline:  # not refreshed since: its TTL passed
                del self._sessions[sid]
                self._unlock(s)
                n += 1
        self.expired += n
        return n

    def shed_one(self) -> bool:
        """Release the lock of the least recently used session that holds one (the session
        stays open); False if none holds anything."""
        if not self._holding:
            return False
        for s in self._sessions.values():
            if s.node is not None:
                self._unlock(s)
                self.shed += 1
                return True
        return False

    def release_all(self) -> int:
        """Release every session's lock (``flush_cache``); the sessions stay open."""
        n = 0
        for s in self._sessions.values():
            if s.node is not None:
                self._unlock(s)
                n += 1
        return n

    def _unlock(self, s: _Session) -> None:
        if s.node is not None:
            node, s.node, s.tokens = s.node, None, 0
            self._holding -= 1
            self.cache.unlock(node)

    # ------------------------------------------------------------------ introspection
    def handles(self) -> Iterator[CacheHandle]:
        """The cache handles sessions hold locks on (integrity checks)."""
        return (s.node for s in self._sessions.values() if s.node is not None)

    def held_tokens(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return s.tokens if s is not None else 0

    def stats(self) -> dict[str, int]:
        held = [s.tokens for s in self._sessions.values() if s.node is not None]
        return {"sessions_open": len(self._sessions), "sessions_holding": len(held),
                "session_retained_tokens": sum(held), "sessions_retained_turns": self.retained,
                "sessions_expired": self.expired, "sessions_closed": self.closed,
                "sessions_evicted": self.evicted, "sessions_shed": self.shed}
