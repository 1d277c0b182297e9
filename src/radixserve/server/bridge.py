"""The bridge between the asyncio HTTP server and the (single-threaded) Engine.

Why a thread: ``Engine.step()`` runs a whole forward pass. Called on the event loop it would
freeze every connection — ``/health`` included — for the length of a long prefill. So the
engine lives on a thread of its own and *only* that thread ever touches it (the engine is
not thread-safe). Everything else talks to it through a command queue:

- the loop thread puts closures (add, abort, flush, stats, integrity check) into a
  thread-safe queue; the engine thread runs them between two steps and hands the result
  back through a ``concurrent.futures.Future`` (awaited with ``asyncio.wrap_future``);
- the engine thread calls ``engine.step()`` while there is work and blocks on the queue
  when there is none (no busy polling while idle);
- each ``RequestOutput`` is handed to the asyncio consumer with
  ``loop.call_soon_threadsafe(queue.put_nowait, out)``.

torch releases the GIL inside its kernels, so the event loop keeps answering while the
model computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixserve.core import RequestOutput
from radixserve.sampling_params import SamplingParams

logger = logging.getLogger("radixserve.server")

T = TypeVar("T")

_STOP = object()


class EngineError(RuntimeError):
    """The engine failed while running a request (a bug or a device error, not bad input)."""


@dataclass
class RequestStream:
    """The outputs of one engine request, delivered on the asyncio loop that submitted it.

    ``label`` is a short description of the prompt for the per-request log line.
    """

    rid: str
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    label: str = ""
    created: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last: RequestOutput | None = None
    finished: bool = False

    async def get(self) -> RequestOutput:
        """The next output of this request; raises EngineError if the engine failed it."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request (never touched by the loop thread)."""

    stream: RequestStream
    last: RequestOutput | None = None


FinishHook = Callable[[RequestStream, RequestOutput], None]


class EngineBridge:
    """Runs an Engine on a dedicated thread; async methods are safe to call from any loop.

    ``on_finish(stream, final_output)`` is called on the engine thread once per request
    (finished, aborted or failed) — the server uses it for metrics and the request log.
    """

    def __init__(self, engine: Any, on_finish: FinishHook | None = None, name: str = "radixserve-engine"):
        self.engine = engine
        self.on_finish = on_finish
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._name = name
        self._lock = threading.Lock()
        self.steps = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._lock:
            if self.running:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        with self._lock:
            t = self._thread
            if t is None:
                return
            self._cmds.put(_STOP)
            t.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ engine-thread calls
    def run_in_engine(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn(engine)`` to run on the engine thread between two steps."""
        if not self.running:
            raise RuntimeError("the engine thread is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def cmd() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller, who decides
                fut.set_exception(e)

        self._cmds.put(cmd)
        return fut

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Await ``fn(engine)`` run on the engine thread."""
        return await asyncio.wrap_future(self.run_in_engine(fn))

    def call_sync(self, fn: Callable[[Any], T], timeout: float | None = 60.0) -> T:
        """Blocking variant for tests and scripts outside the event loop."""
        return self.run_in_engine(fn).result(timeout)

    async def stats(self) -> dict[str, Any]:
        return await self.call(lambda e: e.stats())

    async def flush_cache(self) -> bool:
        return await self.call(lambda e: e.flush_cache())

    async def check_integrity(self) -> dict[str, Any]:
        """Run the engine's invariant check; returns the stats it was checked against."""

        def fn(e: Any) -> dict[str, Any]:
            e.check_integrity()
            return e.stats()

        return await self.call(fn)

    # ------------------------------------------------------------------ requests
    async def submit(
        self,
        items: Sequence[tuple[str, str | list[int], SamplingParams]],
        labels: Sequence[str] | None = None,
    ) -> list[RequestStream]:
        """Add requests ``(rid, prompt, params)`` atomically: all are queued, or none is
        (the engine's ValueError is re-raised and the ones already added are aborted).

        Adding them in one command puts them in the same scheduling round, which is what
        lets n > 1 choices share the prompt they have in common.
        """
        loop = asyncio.get_running_loop()
        streams = [
            RequestStream(
                rid=rid,
                prompt_tokens=len(prompt) if isinstance(prompt, list) else 0,
                loop=loop,
                label=labels[i] if labels else "",
            )
            for i, (rid, prompt, _) in enumerate(items)
        ]

        def add(engine: Any) -> None:
            added: list[str] = []
            try:
                for (rid, prompt, params), stream in zip(items, streams):
                    engine.add_request(prompt, params, request_id=rid)
                    added.append(rid)
                    self._tracked[rid] = _Tracked(stream)
            except BaseException:
                for rid in added:
                    engine.abort(rid)
                    self._tracked.pop(rid, None)
                raise

        await self.call(add)
        return streams

    def abort_nowait(self, rid: str) -> None:
        """Abort a request without waiting (safe inside a cancelled task's ``finally``)."""
        if self.running:
            self._cmds.put(lambda: self._abort(rid))

    async def abort(self, rid: str) -> bool:
        return await self.call(lambda e: self._abort(rid))

    def _abort(self, rid: str) -> bool:
        """Engine thread: abort, then tell the consumer (if any) with a final output."""
        ok = bool(self.engine.abort(rid))
        tr = self._tracked.pop(rid, None)
        if tr is not None:
            final = self._synthetic_final(tr, "abort")
            self._deliver(tr.stream, final)
            self._finished(tr.stream, final)
        return ok

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        logger.debug("engine thread started")
        try:
            while True:
                cmds: list[Any] = []
                if not self.engine.has_unfinished():
                    cmds.append(self._cmds.get())  # idle: block until there is something to do
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if cmd is _STOP:
                        self._shutdown()
                        return
                    try:
                        cmd()
                    except Exception:  # run_in_engine already routes errors; this is a bug
                        logger.exception("engine command failed")
                if self.engine.has_unfinished():
                    self._step()
        except BaseException:
            logger.exception("engine thread crashed")
            self._fail_all(EngineError("the engine thread crashed"))
            raise

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            # The engine is in an unknown state for the requests of this batch; fail them
            # all (clients get a 500 with the message) rather than hang them.
            logger.exception("engine.step() failed")
            self.last_error = f"{type(e).__name__}: {e}"
            self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self.steps += 1
        for out in outs:
            tr = self._tracked.get(out.request_id)
            if tr is None:
                continue  # aborted meanwhile, or not ours
            tr.last = out
            self._deliver(tr.stream, out)
            if out.finished:
                del self._tracked[out.request_id]
                self._finished(tr.stream, out)

    def _deliver(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:
            # The consumer's loop is closed (server shutting down); nobody is listening.
            pass

    def _finished(self, stream: RequestStream, out: RequestOutput) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(stream, out)
            except Exception:
                logger.exception("on_finish hook failed")

    def _synthetic_final(self, tr: _Tracked, reason: str, error: str | None = None) -> RequestOutput:
        """A final output for a request the engine will not report any more (abort/error)."""
        last = tr.last
        now = time.monotonic()
        if last is None:
            return RequestOutput(
                request_id=tr.stream.rid,
                prompt_tokens=tr.stream.prompt_tokens,
                cached_tokens=0,
                token_ids=[],
                text="",
                finished=True,
                finish_reason=reason,
                error=error,
                arrival_time=tr.stream.created,
                finish_time=now,
            )
        return RequestOutput(
            request_id=last.request_id,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            token_ids=list(last.token_ids),
            text=last.text,
            finished=True,
            finish_reason=reason,
            error=error,
            logprobs=last.logprobs,
            top_logprobs=last.top_logprobs,
            prompt_logprobs=last.prompt_logprobs,
            prompt_top_logprobs=last.prompt_top_logprobs,
            prompt_token_ids=last.prompt_token_ids,
            arrival_time=last.arrival_time,
            first_token_time=last.first_token_time,
            finish_time=now,
        )

    def _fail_all(self, err: EngineError) -> None:
        for rid, tr in list(self._tracked.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s after an engine failure failed", rid)
            self._deliver(tr.stream, err)
            self._finished(tr.stream, self._synthetic_final(tr, "error", str(err)))
        self._tracked.clear()

    def _shutdown(self) -> None:
        for rid in list(self._tracked):
            try:
                self._abort(rid)
            except Exception:
                logger.exception("abort of %s at shutdown failed", rid)
        logger.debug("engine thread stopped")
