"""The API process's client of an engine core: everything runs on one asyncio event loop.

Commands issued within one turn of the loop are batched into one message (a flush scheduled
with ``call_soon``), so the n choices of a request reach the same scheduling round; a
watchdog notices a core that died without a word and fails what was open.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.request import RequestOutput
from radixserve.engine.client import ClientBase, EngineCallError, EngineDeadError, Submission, shown_prompt
from radixserve.engine.launch import CoreHandle
from radixserve.engine.messages import Abort, AddRequest, Call, CallResult, Shutdown

log = logging.getLogger("radixserve.engine")

WATCHDOG_INTERVAL_S = 0.2
LAST_WORDS_GRACE_S = 0.1  # after the core exited, time for its final message to be read


@dataclass
class RequestStream:
    """The outputs of one request, delivered on the event loop that submitted it."""

    rid: str
    prompt_tokens: int
    created: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last: RequestOutput | None = None
    finished: bool = False

    async def get(self) -> RequestOutput:
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


class AsyncEngineClient(ClientBase):
    """The API process's view of the core. All methods run on one event loop."""

    def __init__(self, tokenizer: Any):
        super().__init__(None, tokenizer)
        self.streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._outbox: list[Any] = []
        self._flush_scheduled = False
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recv: zmq.asyncio.Socket | None = None

    async def start(self, handle: CoreHandle, timeout: float) -> None:
        """Wait for the core's Ready (or its failure, or its death), then serve outputs."""
        self.handle = handle
        self._loop = asyncio.get_running_loop()
        self._recv = zmq.asyncio.Socket.shadow(self.handle.out_sock.underlying)
        deadline = time.monotonic() + timeout
        while not await self._recv.poll(100):
            if not self.handle.alive():
                self.dead_reason = f"the engine core {self.handle.exit_description()} while starting"
                raise EngineDeadError(self.dead_reason)
            if time.monotonic() > deadline:
                self.dead_reason = f"the engine core did not start within {timeout:.0f}s"
                raise EngineDeadError(self.dead_reason)
        self._handle_hello(await self._recv.recv())
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watchdog())]

    # ---- sending
    def _send(self, cmd: Any) -> None:
        self._outbox.append(cmd)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._outbox or self.dead_reason is not None:
            self._outbox.clear()
            return
        cmds, self._outbox = self._outbox, []
        try:
            payload = self.enc.encode(cmds)
        except (TypeError, ValueError, OverflowError):
            # One command the wire cannot carry must not take the others down with it.
            good = []
            for c in cmds:
                try:
                    self.enc.encode([c])
                    good.append(c)
                except (TypeError, ValueError, OverflowError) as e:
                    log.error("cannot send %s to the engine core: %s", type(c).__name__, e)
                    if isinstance(c, AddRequest):
                        self._fail_local(c.rid, f"the request cannot be sent to the engine: {e}")
            if not good:
                return
            payload = self.enc.encode(good)
        self.handle.cmd_sock.send(payload)

    def _fail_local(self, rid: str, error: str) -> None:
        final = self.processor.fail(rid, "error", error)
        s = self.streams.pop(rid, None)
        if s is not None and final is not None:
            s.queue.put_nowait(final)
            self._notify(final)  # guarded: a failing hook must not drop the batch's other commands

    def submit(self, items: Sequence[Submission]) -> list[RequestStream]:
        """Queue requests (all in one message, so they share a scheduling round)."""
        self._check_alive()
        now = time.monotonic()
        streams = []
        for it in items:
            if it.rid in self.streams:
                raise ValueError(f"request id {it.rid!r} is already in use")
        for it in items:
            shown = shown_prompt(it, self.info)
            s = RequestStream(it.rid, len(shown), created=now)
            self.streams[it.rid] = s
            self.processor.add(it.rid, shown, it.params, now)
            self._send(it.command(now))
            streams.append(s)
        return streams

    def abort(self, rid: str) -> bool:
        """Abort a request of this client (False if it is not running)."""
        if rid not in self.streams or self.dead_reason is not None:
            return False
        self._send(Abort([rid]))
        return True

    async def call(self, method: str, timeout: float = 60.0, **args: Any) -> Any:
        """Run a utility on the core between two steps and return its value."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(Call(call_id, method, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    # ---- receiving
    async def _receive(self) -> None:
        assert self._recv is not None
        while True:
            try:
                raw = await self._recv.recv()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as e:
                self._die(f"the engine connection failed: {e}")
                return
            try:
                msg = self.out_dec.decode(raw)
            except msgspec.DecodeError as e:
                log.error("dropping a malformed message from the core: %s", e)
                continue
            if msg.fatal is not None:
                self._die(f"the engine core stopped: {msg.fatal}")
                return
            outs, stop = self._process(msg)
            for rid in stop:
                self._send(Abort([rid], "stop"))
            for o in outs:
                s = self.streams.get(o.request_id)
                if s is None:
                    continue
                if o.finished:
                    del self.streams[o.request_id]
                s.queue.put_nowait(o)
                self._notify(o)
            for r in msg.results:
                self._resolve(r)

    def _notify(self, o: RequestOutput) -> None:
        for cb in self.on_output:
            try:
                cb(o)
            except Exception:
                log.exception("output hook failed")

    def _resolve(self, r: CallResult) -> None:
        fut = self._calls.get(r.call_id)
        if fut is None or fut.done():
            return
        if r.ok:
            fut.set_result(r.value)
        elif r.error_type == "AssertionError":
            fut.set_exception(AssertionError(r.error))
        elif r.error_type == "ValueError":
            fut.set_exception(ValueError(r.error))
        else:
            fut.set_exception(EngineCallError(r.error or "engine call failed", r.error_type))

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if not self.handle.alive():
                # The core may have sent its last words (why it stopped) just before exiting:
                # give the receiver a moment to read them before reporting a bare exit.
                await asyncio.sleep(LAST_WORDS_GRACE_S)
                if self.dead_reason is None:
                    self._die(f"the engine core {self.handle.exit_description()}")

    def _die(self, reason: str, quiet: bool = False) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not quiet or self.streams:
            log.error("%s; failing %d open request(s)", reason, len(self.streams))
        err = EngineDeadError(reason)
        for rid, s in list(self.streams.items()):
            final = self.processor.fail(rid, "error", reason)
            if final is not None:
                self._notify(final)
            s.queue.put_nowait(err)
        self.streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)

    async def close(self, timeout: float = 10.0) -> None:
        """Stop the core (aborting what runs) and release the sockets."""
        if self.handle is None:
            return
        if self.ready and self.dead_reason is None and self.handle.alive():
            self._outbox.append(Shutdown())
            self._flush()
        self._die("the server is shutting down", quiet=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.handle.join, timeout)
        self.handle.close()
