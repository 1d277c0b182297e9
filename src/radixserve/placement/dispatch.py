"""Routing between the engine cores of one server (``radixserve serve --dp N``), no HTTP.

The API process of a data-parallel server talks to its N engine cores in token ids; it
needs the router's decision but none of its HTTP: :class:`CoreDispatcher` is the same
policies over the same event-fed mirrors, with the cores' health set by the caller (it
knows when a core process died). Runs on the API process's asyncio loop.

    disp = CoreDispatcher(["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"])
    await disp.start()
    t = disp.pick(prompt_ids, salt)      # t.worker.index: the core to send the request to
    ...                                  # when the request ends (any way):
    disp.finish(t)
"""

from __future__ import annotations

from typing import Any, Hashable, List, Optional, Sequence, Union

from radixserve.config_rules import DEFAULT_ROUTER_POLICY
from radixserve.placement.config import RouterConfig
from radixserve.placement.mirror import pack
from radixserve.placement.policies import RouteRequest, make_policy
from radixserve.placement.worker import NoWorkerAvailable, Ticket, Worker

__all__ = ["CoreDispatcher"]


class CoreDispatcher:
    def __init__(self, events: Sequence[str], policy: str = DEFAULT_ROUTER_POLICY, **options: Any) -> None:
        """``events``: each core's cache-event endpoint (its ``--kv-events-endpoint``), in
        core order. ``options``: :class:`RouterConfig` fields (thresholds, weights)."""
        if not events:
            raise ValueError("events: one endpoint per engine core is required")
        names = tuple(f"http://engine-core-{i}" for i in range(len(events)))
        self.config = RouterConfig(workers=names, worker_events=tuple(events), policy=policy, **options)
        self.workers: List[Worker] = [Worker(i, names[i], e) for i, e in enumerate(events)]
        for w in self.workers:
            w.healthy = True  # the caller says otherwise (set_available)
        self.policy = make_policy(self.config)
        self._subscribers: list = []
        self._ctx: Any = None

    async def start(self) -> None:
        import zmq.asyncio

        from radixserve.placement.events import EventSubscriber

        self._ctx = zmq.asyncio.Context()
        for w in self.workers:
            s = EventSubscriber(w, self._ctx, stale_s=self.config.mirror_stale_s)
            s.start()
            self._subscribers.append(s)

    async def stop(self) -> None:
        for s in self._subscribers:
            await s.stop()
        self._subscribers.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def set_available(self, index: int, ok: bool) -> None:
        """A core died (False) or is back (True; its mirror resyncs from a snapshot)."""
        w = self.workers[index]
        if ok == w.healthy:
            return
        w.healthy = ok
        if not ok and w.mirror is not None:
            w.mirror.invalidate()
        elif ok:
            for s in self._subscribers:
                if s.worker is w:
                    s.request_resync()

    def pick(self, tokens: Union[Sequence[int], bytes], salt: Hashable = None,
             exclude: Sequence[int] = ()) -> Ticket:
        """Choose a core for a prompt; the ticket counts it in flight there until :meth:`finish`."""
        q = pack(tokens)
        candidates = [w for w in self.workers if w.healthy and w.index not in exclude]
        if not candidates:
            raise NoWorkerAvailable("no engine core is available")
        req = RouteRequest(q, salt)
        c = self.policy.choose(req, candidates)
        self.policy.placed(req, c.worker)
        t = Ticket(c.worker, q, salt, c.compute_tokens, c.cached_tokens, c.low_priority_from)
        c.worker.begin(t, c.new_prefix)
        return t

    def finish(self, ticket: Ticket) -> None:
        ticket.worker.end(ticket)

    def mirror_synced(self, index: Optional[int] = None) -> bool:
        ws = self.workers if index is None else [self.workers[index]]
        return all(w.mirror is not None and w.mirror.synced for w in ws)
