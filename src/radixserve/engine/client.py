"""Clients of an engine core: the API process's asyncio client and a blocking one.

Both send :data:`~radixserve.engine.messages.Command` lists and turn the core's
:class:`StepOutputs` into :class:`RequestOutput` s with one :class:`OutputProcessor`
(detokenization and stop strings happen here, never in the core). Commands issued in one
go (the n choices of a request, an abort burst) are sent as one message, so they reach the
same scheduling round.

If the core dies, every open request fails at once with :class:`EngineDeadError` and
every later call raises it: nothing waits on a core that is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.core import RequestOutput
from radixserve.engine.launch import CoreHandle
from radixserve.engine.messages import (
    Abort, AddRequest, Call, CallResult, Failed, Load, Ready, Shutdown, StepOutputs,
    command_encoder, hello_decoder, images_to_wire, output_decoder,
)
from radixserve.engine.output import OutputProcessor
from radixserve.images import ImageInput, expand_prompt, keyed_prompt
from radixserve.sampling_params import SamplingParams

log = logging.getLogger("radixserve.engine")

WATCHDOG_INTERVAL_S = 0.2
LAST_WORDS_GRACE_S = 0.1  # after the core exited, time for its final message to be read


class EngineDeadError(RuntimeError):
    """The engine core is not running (it failed to start, crashed, or was stopped)."""


class EngineCallError(RuntimeError):
    """A utility call failed inside the core; ``error_type`` names the exception there."""

    def __init__(self, message: str, error_type: str | None):
        super().__init__(message)
        self.error_type = error_type


@dataclass
class Submission:
    """One request for the core: token ids, sampling params, cache salt, session, and for a
    vision-language model its images (one per image placeholder token of ``prompt_ids``)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    session_id: str | None = None
    images: Sequence[ImageInput] = ()

    def command(self, arrival: float) -> AddRequest:
        return AddRequest(self.rid, self.prompt_ids, self.params, self.salt, arrival, self.session_id,
                          images_to_wire(self.images))


def _with_images(item: Submission, info: dict[str, Any], keyed: bool) -> list[int]:
    """``item``'s prompt expanded as the core expands it (``keyed``: with the image positions'
    tree keys); unchanged without images, or when the placeholders do not match (the core
    refuses the request then, with the reason)."""
    vision = info.get("vision")
    if not item.images or not vision:
        return item.prompt_ids
    args = (item.prompt_ids, int(vision["image_token_id"]), int(vision["tokens_per_image"]),
            [im.digest for im in item.images])
    try:
        return keyed_prompt(*args) if keyed else expand_prompt(*args)[0]
    except ValueError:
        return item.prompt_ids


def shown_prompt(item: Submission, info: dict[str, Any]) -> list[int]:
    """The prompt as the core runs it: each image placeholder expanded to the model's
    ``tokens_per_image`` (so prompt token counts and ``prompt_token_ids`` match what the core
    computed and cached)."""
    return _with_images(item, info, keyed=False)


def cache_key_tokens(item: Submission, info: dict[str, Any]) -> list[int]:
    """The prompt's prefix-tree keys as the core derives them, for routing by the cores'
    cache events (``radixserve.images.keyed_prompt``)."""
    return _with_images(item, info, keyed=True)


class _ClientBase:
    """What both clients share: the request table, the output processor, the sockets."""

    def __init__(self, handle: CoreHandle | None, tokenizer: Any):
        self.handle: CoreHandle = handle  # type: ignore[assignment]
        self.processor = OutputProcessor(tokenizer)
        self.enc = command_encoder()
        self.out_dec = output_decoder()
        self.info: dict[str, Any] = {}
        self.load: Load | None = None
        self.ready = False
        self.dead_reason: str | None = None
        self._call_ids = itertools.count(1)
        self.on_output: list[Callable[[RequestOutput], None]] = []

    @property
    def alive(self) -> bool:
        return self.ready and self.dead_reason is None

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.ready:
            raise EngineDeadError("the engine core is not ready yet")

    def _handle_hello(self, raw: bytes) -> None:
        hello = hello_decoder().decode(raw)
        if isinstance(hello, Failed):
            self.dead_reason = f"the engine core failed to start: {hello.error}"
            raise EngineDeadError(self.dead_reason)
        assert isinstance(hello, Ready)
        self.info = hello.info
        self.ready = True

    def _process(self, msg: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        if msg.load is not None:
            self.load = msg.load
        return self.processor.process(msg.outputs)


# --------------------------------------------------------------------------- asyncio client
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


class AsyncEngineClient(_ClientBase):
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
        while True:
            if await self._recv.poll(100):
                self._handle_hello(await self._recv.recv())
                break
            if not self.handle.alive():
                self.dead_reason = f"the engine core {self.handle.exit_description()} while starting"
                raise EngineDeadError(self.dead_reason)
            if time.monotonic() > deadline:
                self.dead_reason = f"the engine core did not start within {timeout:.0f}s"
                raise EngineDeadError(self.dead_reason)
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
            for cb in self.on_output:
                cb(final)

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
                for cb in self.on_output:
                    try:
                        cb(o)
                    except Exception:
                        log.exception("output hook failed")
            for r in msg.results:
                self._resolve(r)

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
                for cb in self.on_output:
                    try:
                        cb(final)
                    except Exception:
                        log.exception("output hook failed")
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


# --------------------------------------------------------------------------- blocking client
class SyncEngineClient(_ClientBase):
    """A thread-safe blocking client (the ``lang`` backend, scripts): a receiver thread
    resolves one future per request and calls ``on_delta`` with each text delta.

    :meth:`close` stops the core and joins its thread; it also runs at interpreter exit
    for a client nobody closed. A core thread (a daemon) still inside a step when Python
    finalizes is ended where it next takes the GIL — on the way out of a torch op, whose
    C++ frames cannot be unwound by ``pthread_exit`` — and the process aborts with
    "terminate called without an active exception". The core is often still stepping
    when a program ends: a request finished here by a stop string runs there until its
    abort arrives.
    """

    def __init__(self, handle: CoreHandle, tokenizer: Any, timeout: float = 600.0):
        super().__init__(handle, tokenizer)
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._deltas: dict[str, Callable[[str], None]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        deadline = time.monotonic() + timeout
        while not self.handle.out_sock.poll(100):
            if not self.handle.alive():
                raise EngineDeadError(f"the engine core {self.handle.exit_description()} while starting")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not start within {timeout:.0f}s")
        self._handle_hello(self.handle.out_sock.recv())
        self._closed = False
        self._shutdown_sent = False
        self._thread = threading.Thread(target=self._run, name="radixserve-client", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def submit(self, item: Submission, on_delta: Callable[[str], None] | None = None
               ) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            if item.rid in self._futures:
                raise ValueError(f"request id {item.rid!r} is already in use")
            self._futures[item.rid] = fut
            if on_delta is not None:
                self._deltas[item.rid] = on_delta
            self.processor.add(item.rid, shown_prompt(item, self.info), item.params)
        self._cmds.put(item.command(time.monotonic()))
        return fut

    def call(self, method: str, timeout: float = 600.0, **args: Any) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self._cmds.put(Call(call_id, method, args))
        return fut.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the core (after the step it is running; open requests fail with
        :class:`EngineDeadError`), join its thread and the receiver, release the sockets.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._cmds.put(Shutdown())
        self._thread.join(timeout)  # the receiver's last act is sending the Shutdown
        if not self._shutdown_sent and not self._thread.is_alive() and self.handle.alive():
            # The receiver had stopped already (the core reported a fatal error): the
            # socket is free, so tell the core directly.
            try:
                self.handle.cmd_sock.send(self.enc.encode([Shutdown()]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.handle.join(timeout)
        if self.handle.alive():
            log.warning("the engine core did not stop within %.0fs of the shutdown request", timeout)
        self._fail_all("the engine client was closed")
        self.handle.close()

    def _run(self) -> None:
        """Receiver thread: forward queued commands, dispatch outputs."""
        sock = self.handle.out_sock
        while True:
            cmds = []
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            if cmds:
                self.handle.cmd_sock.send(self.enc.encode(cmds))
                if any(isinstance(c, Shutdown) for c in cmds):
                    self._shutdown_sent = True
                    return
            if sock.poll(5):
                msg = self.out_dec.decode(sock.recv())
                if msg.fatal is not None:
                    self._fail_all(f"the engine core stopped: {msg.fatal}")
                    return
                with self._lock:
                    outs, stop = self._process(msg)
                for rid in stop:
                    self._cmds.put(Abort([rid], "stop"))
                for o in outs:
                    self._deliver(o)
                for r in msg.results:
                    fut = self._calls.pop(r.call_id, None)
                    if fut is not None:
                        if r.ok:
                            fut.set_result(r.value)
                        else:
                            fut.set_exception(AssertionError(r.error) if r.error_type == "AssertionError"
                                              else EngineCallError(r.error or "", r.error_type))
            elif not self.handle.alive():
                self._fail_all(f"the engine core {self.handle.exit_description()}")
                return

    def _deliver(self, o: RequestOutput) -> None:
        cb = self._deltas.get(o.request_id)
        if cb is not None and o.delta_text:
            try:
                cb(o.delta_text)
            except Exception:  # a consumer's bug must not kill the receiver
                log.exception("on_delta callback failed")
        if o.finished:
            with self._lock:
                fut = self._futures.pop(o.request_id, None)
                self._deltas.pop(o.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(o)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self.dead_reason is None:
                self.dead_reason = reason
            futs = list(self._futures.values()) + list(self._calls.values())
            self._futures.clear()
            self._calls.clear()
        for f in futs:
            if not f.done():
                f.set_exception(EngineDeadError(reason))
