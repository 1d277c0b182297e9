"""The router's state and background work: workers, policy, health checks, event mirrors.

:class:`Router` is transport-agnostic apart from its health checks; the HTTP front
(:mod:`radixserve.router.app`) asks it to ``pick`` a worker for a tokenized request and
reports how the upstream call ended (``finish``). Everything runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Hashable, List, Optional, Sequence

from radixserve.placement.config import RouterConfig
from radixserve.protocol.native import ServedModelInfo
from radixserve.placement.policies import Choice, RouteRequest, make_policy
from radixserve.router.upstream import UpstreamClient, UpstreamError
from radixserve.placement.worker import NoWorkerAvailable, Ticket, Worker
from radixserve.tenancy import KeyRing, cache_salt

__all__ = ["Router", "NoWorkerAvailable"]

logger = logging.getLogger("radixserve.router")


class Router:
    def __init__(self, config: RouterConfig, tokenizer=None) -> None:
        self.config = config
        self.workers: List[Worker] = [
            Worker(i, url, config.worker_events[i] if config.worker_events else None)
            for i, url in enumerate(config.workers)
        ]
        self.policy = make_policy(config)
        #: The workers' keys: which tenant a request's key belongs to decides the namespace
        #: (salt) its prefix is filed under in the workers' trees.
        self.keyring = KeyRing(config.api_key, config.api_key_file, config.admin_key)
        self.tokenizer = tokenizer  # a RequestTokenizer, set in start() if not given
        self.client: Optional[UpstreamClient] = None
        self._subscribers: list = []
        self._zmq_ctx = None
        self._health_task: Optional[asyncio.Task] = None
        self._probe_tasks: set = set()
        self.requests = self.retries = self.failed_requests = self.stream_errors = 0  # counters
        self.route_seconds = 0.0
        for w in self.workers:
            w.on_down.append(self._worker_down)
            w.on_up.append(self._worker_up)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        self.client = UpstreamClient(connect_timeout=min(5.0, cfg.request_timeout_s or 5.0),
                                     read_timeout=cfg.request_timeout_s or None)
        await self.check_all()
        if self.tokenizer is None:
            from radixserve.router.tokenize import RequestTokenizer, load_tokenizer

            info = await self._model_info_from_workers()
            name = cfg.model or info.tokenizer_path or info.model_path
            self.tokenizer = RequestTokenizer(await asyncio.to_thread(load_tokenizer, name), vision=info.vision)
        if any(w.mirror is not None for w in self.workers):
            import zmq.asyncio

            from radixserve.placement.events import EventSubscriber

            self._zmq_ctx = zmq.asyncio.Context()
            for w in self.workers:
                if w.mirror is not None:
                    s = EventSubscriber(w, self._zmq_ctx, stale_s=cfg.mirror_stale_s)
                    s.start()
                    self._subscribers.append(s)
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        for t in list(self._probe_tasks):
            t.cancel()
        for s in self._subscribers:
            await s.stop()
        self._subscribers.clear()
        if self._zmq_ctx is not None:
            self._zmq_ctx.term()
            self._zmq_ctx = None
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def _model_info_from_workers(self) -> ServedModelInfo:
        """A worker's ``/get_model_info``: its model (unless ``--model`` names it) and, for a
        vision-language model, how its images become tree keys.

        Also checks that the router and the workers agree on keys: a request's cache
        namespace is derived from its key's tenant, so with keys on one side only, no
        look-up in the mirrors could ever find what the workers hold."""
        assert self.client is not None
        last: Exception | None = None
        for w in self.workers:
            try:
                status, _, data = await self.client.fetch("GET", w.url, "/get_model_info",
                                                          headers=self.keyring.auth_headers(),
                                                          timeout=self.config.health_timeout_s)
                if status == 401:
                    raise RuntimeError(
                        f"{w.url} asks for an API key: give the router the workers' keys "
                        "(--api-key / --api-key-file / --admin-key), so it files each request "
                        "under its tenant's cache namespace as they do")
                if status == 200 and self.keyring.enabled:
                    bare, _, _ = await self.client.fetch("GET", w.url, "/get_model_info",
                                                         timeout=self.config.health_timeout_s)
                    if bare == 200:
                        raise RuntimeError(
                            f"{w.url} takes no API key but the router was given keys: the "
                            "workers file requests under no tenant, so drop the router's keys")
                if status == 200:
                    info = ServedModelInfo.parse(data)
                    if self.config.model or info.tokenizer_path or info.model_path:
                        return info
                    last = KeyError("model_path")
            except (UpstreamError, ValueError, KeyError) as e:
                last = e
        if self.config.model:
            return ServedModelInfo()
        raise RuntimeError(f"no worker told its model (pass --model): {last!r}")

    # ------------------------------------------------------------------ health
    async def _probe(self, w: Worker) -> bool:
        assert self.client is not None
        try:
            status, _, _ = await self.client.fetch("GET", w.url, "/health", timeout=self.config.health_timeout_s)
            return status == 200
        except UpstreamError:
            return False

    async def check_all(self) -> None:
        results = await asyncio.gather(*(self._probe(w) for w in self.workers))
        for w, ok in zip(self.workers, results):
            w.health_result(ok, self.config)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("health check round failed")

    def probe_soon(self, w: Worker) -> None:
        """Check ``w`` now (a request to it just failed) instead of at the next round."""
        async def run() -> None:
            w.health_result(await self._probe(w), self.config)
        t = asyncio.create_task(run())
        self._probe_tasks.add(t)
        t.add_done_callback(self._probe_tasks.discard)

    def _worker_down(self, w: Worker) -> None:
        n = w.cancel_all()
        logger.warning("worker %s is out (%d request(s) in flight moved or failed)", w.url, n)
        if w.mirror is not None:
            w.mirror.invalidate()

    def _worker_up(self, w: Worker) -> None:
        logger.info("worker %s is back", w.url)
        for s in self._subscribers:
            if s.worker is w and not w.mirror.synced:  # type: ignore[union-attr]
                s.request_resync()

    # ------------------------------------------------------------------ routing
    def namespace(self, authorization: Optional[bytes], request_salt: Optional[str]) -> Hashable:
        """The salt a worker files this request's prefix under: its tenant's namespace
        narrowed by its ``cache_salt``, derived as the worker derives it (same key ring, same
        :func:`~radixserve.tenancy.cache_salt`), so mirror look-ups find what the workers
        hold. A key the workers will refuse has no cache to find (None)."""
        principal = self.keyring.principal(authorization)
        return None if principal is None else cache_salt(principal, request_salt)

    def available(self, exclude: Sequence[Worker] = ()) -> List[Worker]:
        now = time.monotonic()
        return [w for w in self.workers if w not in exclude and w.available(now)]

    def least_loaded(self, exclude: Sequence[Worker] = ()) -> Worker:
        """An available worker for a request that is not generation (model info, health)."""
        candidates = self.available(exclude)
        if not candidates:
            raise NoWorkerAvailable("no worker is available")
        return min(candidates, key=lambda w: (w.outstanding, w.index))

    def pick(self, tokens: bytes, salt: Hashable = None, exclude: Sequence[Worker] = ()) -> Ticket:
        """Choose a worker for a prompt and count the request in flight there."""
        candidates = self.available(exclude)
        if not candidates:
            raise NoWorkerAvailable(
                "no worker is available" + (" (the others failed this request)" if exclude else ""))
        t0 = time.perf_counter()
        req = RouteRequest(tokens, salt)
        choice: Choice = self.policy.choose(req, candidates)
        self.policy.placed(req, choice.worker)
        self.route_seconds += time.perf_counter() - t0
        ticket = Ticket(choice.worker, tokens, salt, choice.compute_tokens, choice.cached_tokens,
                        choice.low_priority_from)
        choice.worker.begin(ticket, choice.new_prefix)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("route %s... (%d tokens) -> worker %d: predicted hit %d; low priority "
                         "from %s; in flight %s", bytes(tokens[:16]).hex(), len(tokens) >> 2,
                         choice.worker.index, choice.cached_tokens, choice.low_priority_from,
                         [w.outstanding for w in self.workers])
        return ticket

    def finish(self, ticket: Ticket, transport_ok: bool) -> None:
        w = ticket.worker
        w.end(ticket)
        w.request_result(transport_ok, self.config)
        if not transport_ok:
            self.probe_soon(w)

    def state(self) -> dict:
        return {"policy": self.config.policy, "requests": self.requests, "retries": self.retries,
                "failed_requests": self.failed_requests, "stream_errors": self.stream_errors,
                "route_seconds": self.route_seconds, **self.policy.state(),
                "workers": [w.state() for w in self.workers]}
