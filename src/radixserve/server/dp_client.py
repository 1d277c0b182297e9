"""Several engine cores behind one API process (``radixserve serve --dp N``).

Each core is a full engine (its own scheduler, prefix cache and KV pool) in its own process
and publishes its cache events; the API process keeps, per core, an exact mirror of its tree
(the router's meta-tree, :class:`~radixserve.placement.dispatch.CoreDispatcher`) and sends each
request to the core where it would compute the fewest tokens, given the cores' queues. The n
choices of one request go to the same core, so they share their prompt.

:class:`DPEngineClient` has the interface of :class:`AsyncEngineClient`, so the routes do
not know whether one core or several serve them. A core that dies is taken out of routing
(its open requests fail with 503); the others go on serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Callable

import msgspec

from radixserve.config_rules import DEFAULT_ROUTER_POLICY
from radixserve.request import RequestOutput
from radixserve.engine.async_client import AsyncEngineClient, RequestStream
from radixserve.engine.client import EngineDeadError, Submission, cache_key_tokens
from radixserve.engine.launch import CoreHandle
from radixserve.engine.messages import Load, ModelInfo
from radixserve.placement.dispatch import CoreDispatcher

log = logging.getLogger("radixserve.server")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_buckets(v: Any) -> bool:
    """A histogram's cumulative ``[(upper bound, count), ...]`` (tuples, or lists off the wire)."""
    return isinstance(v, (list, tuple)) and all(
        isinstance(b, (list, tuple)) and len(b) == 2 and _is_number(b[0]) and _is_number(b[1]) for b in v)


def _summed(a: Any, b: Any) -> Any:
    """``b`` added to ``a``: numbers summed, dicts merged key by key, histogram buckets of the
    same bounds summed bound by bound; anything else keeps ``a`` (the first core's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _summed(out[k], v) if k in out else v
        return out
    if _is_number(a) and _is_number(b):
        return a + b
    if _is_buckets(a) and _is_buckets(b) and [x[0] for x in a] == [x[0] for x in b]:
        return [(x[0], x[1] + y[1]) for x, y in zip(a, b)]
    return a


def merge_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-core stats added up (numbers summed, nested dicts merged, histograms summed), then
    the top level's rates recomputed and ``dp_size`` set (there only: a nested dict is a
    labelled family, where it would read as one more label value)."""
    out: dict[str, Any] = {}
    for p in parts:
        out = _summed(out, p)
    q = out.get("prefix_cache_query_tokens")
    if q is not None:
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0) / q if q else 0.0
    cap = out.get("kv_capacity_tokens")
    if cap:
        out["kv_usage"] = (cap - out.get("kv_free_tokens", 0)) / cap
    waits = [p["max_wait_seconds"] for p in parts if "max_wait_seconds" in p]
    if waits:
        out["max_wait_seconds"] = max(waits)
    out["dp_size"] = len(parts)
    return out


class DPEngineClient:
    """N :class:`AsyncEngineClient` s and a cache-aware dispatcher between them."""

    def __init__(self, tokenizer: Any, events: Sequence[str], policy: str = DEFAULT_ROUTER_POLICY,
                 tmpdir: str | None = None):
        self.clients = [AsyncEngineClient(tokenizer) for _ in events]
        self.dispatcher = CoreDispatcher(list(events), policy=policy)
        self.streams: dict[str, RequestStream] = {}
        self._where: dict[str, tuple[int, Any]] = {}  # rid -> (core, dispatcher ticket)
        self._pending: dict[int, int] = {}  # id(ticket) -> requests of it still running
        self.on_output: list[Callable[[RequestOutput], None]] = []
        self.tmpdir = tmpdir  # the private directory of the cores' event sockets
        for i, c in enumerate(self.clients):
            c.on_output.append(lambda out, i=i: self._output(i, out))

    # ---- the AsyncEngineClient interface
    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        if any(c.dead_reason is None for c in self.clients):
            return None
        return "; ".join(f"core {i}: {c.dead_reason}" for i, c in enumerate(self.clients))

    @property
    def alive(self) -> bool:
        return self.ready and self.dead_reason is None

    @property
    def info(self) -> ModelInfo | None:
        infos = [c.info for c in self.clients]
        if infos[0] is None:
            return None
        # A request must fit one core; the server's capacity is all of them.
        running = sum(i.max_running_requests for i in infos if i is not None)
        return msgspec.structs.replace(infos[0], max_running_requests=running, dp_size=len(self.clients))

    @property
    def load(self) -> Load | None:
        loads = [c.load for c in self.clients if c.load is not None]
        if not loads:
            return None
        return Load(sum(x.running for x in loads), sum(x.waiting for x in loads),
                    sum(x.kv_free_tokens for x in loads))

    async def start(self, handles: Sequence[CoreHandle], timeout: float) -> None:
        await asyncio.gather(*(c.start(h, timeout) for c, h in zip(self.clients, handles)))
        await self.dispatcher.start()
        asyncio.get_running_loop().create_task(self._watch())

    def submit(self, items: Sequence[Submission]) -> list[RequestStream]:
        """Route the requests (items with the same prompt and salt — the n choices of one
        request — to the same core) and submit them, one message per core."""
        for i, c in enumerate(self.clients):
            if c.dead_reason is not None:
                self.dispatcher.set_available(i, False)
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        picks: dict[tuple, tuple[int, Any]] = {}
        groups: dict[int, list[int]] = {}
        tickets = []
        info = self.info

        def key_of(it: Submission) -> tuple:
            return (tuple(it.prompt_ids), tuple(im.digest for im in it.images), it.salt)

        for k, it in enumerate(items):
            key = key_of(it)
            if key not in picks:
                t = self.dispatcher.pick(cache_key_tokens(it, info), it.salt)
                picks[key] = (t.worker.index, t)
                tickets.append(t)
            core, t = picks[key]
            groups.setdefault(core, []).append(k)
            if it.low_priority_from is None:  # the client's own hint wins over the policy's
                it.low_priority_from = t.low_priority_from
        streams: list[RequestStream | None] = [None] * len(items)
        try:
            for core, idx in groups.items():
                for k, s in zip(idx, self.clients[core].submit([items[k] for k in idx])):
                    streams[k] = s
                    self.streams[s.rid] = s
                    self._where[s.rid] = (core, picks[key_of(items[k])][1])
        except Exception:
            for s in streams:
                if s is not None:
                    self.abort(s.rid)
            raise
        # One dispatcher ticket per distinct prompt: finished when its last request ends.
        for t in tickets:
            self._pending[id(t)] = sum(1 for s in streams if s is not None and self._where[s.rid][1] is t)
        return streams  # type: ignore[return-value]

    def abort(self, rid: str) -> bool:
        where = self._where.get(rid)
        return where is not None and self.clients[where[0]].abort(rid)

    async def call(self, method: str, timeout: float = 60.0, **args: Any) -> Any:
        live = [c for c in self.clients if c.alive]
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core is ready")
        results = await asyncio.gather(*(c.call(method, timeout=timeout, **args) for c in live))
        if method in ("stats", "check_integrity"):
            return merge_stats(results)
        if method == "flush_cache" and all(results) and len(live) == len(self.clients):
            self.dispatcher.policy.forget()  # no prompt routed so far is held anywhere
        if method in ("flush_cache", "health", "open_session"):
            return all(results)
        if method == "close_session":
            return any(results)
        return results[0]

    async def close(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(c.close(timeout) for c in self.clients), return_exceptions=True)
        await self.dispatcher.stop()
        if self.tmpdir:
            import shutil

            shutil.rmtree(self.tmpdir, ignore_errors=True)

    # ---- internals
    def _output(self, core: int, out: RequestOutput) -> None:
        if out.finished:
            self.streams.pop(out.request_id, None)
            where = self._where.pop(out.request_id, None)
            if where is not None:
                t = where[1]
                left = self._pending.get(id(t), 1) - 1
                if left <= 0:
                    self._pending.pop(id(t), None)
                    self.dispatcher.finish(t)
                else:
                    self._pending[id(t)] = left
        for cb in self.on_output:
            cb(out)

    async def _watch(self) -> None:
        while any(c.dead_reason is None for c in self.clients):
            await asyncio.sleep(0.2)
            for i, c in enumerate(self.clients):
                if c.dead_reason is not None:
                    self.dispatcher.set_available(i, False)
