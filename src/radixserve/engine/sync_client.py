"""A blocking, thread-safe client of an engine core (the ``lang`` backend, scripts).

A receiver thread forwards queued commands and dispatches outputs, so callers on any
thread get a future per request and never touch the sockets.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from radixserve.request import RequestOutput
from radixserve.engine.client import ClientBase, EngineCallError, EngineDeadError, Submission, shown_prompt
from radixserve.engine.launch import CoreHandle
from radixserve.engine.messages import Abort, Call, Shutdown

log = logging.getLogger("radixserve.engine")


class SyncEngineClient(ClientBase):
    """A thread-safe blocking client (the ``lang`` backend, scripts): a receiver thread
    resolves one future per request and calls ``on_delta`` with each text delta.

    :meth:`close` stops the core and joins its thread; it also runs at interpreter exit
    for a client nobody closed. A core thread (a daemon) still inside a step when Python
    finalizes is ended where it next takes the GIL — on the way out of a torch op, whose
    C++ frames cannot be unwound by ``pthread_exit`` — and the process aborts with
    "terminate called without an active exception". The core is often still stepping
    when a program ends: a request finished here by a stop string runs there until its
    abort arrives."""

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
