"""The engine-core loop: commands in, one step, outputs out — over two ZMQ sockets.

The same function runs in the engine-core process (``radixserve serve``) and on a thread
(``core_in_process``, tests, the ``lang`` backend), so there is one driver of
:meth:`EngineCore.step`. Per iteration it drains every command that arrived (adds, aborts,
utility calls), runs one step when there is work, and sends one :class:`StepOutputs`
message. With nothing to do it blocks on the command socket instead of spinning.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from typing import Any, Callable

import zmq

from radixserve.engine.core import EngineCore
from radixserve.engine.messages import (
    Abort, AddRequest, Call, CallResult, Failed, Ready, ReqDelta, Shutdown, StepOutputs,
    command_decoder, command_encoder, images_from_wire,
)

log = logging.getLogger("radixserve.engine")

IDLE_POLL_MS = 1000  # blocking wait while idle; bounds how late a dead parent is noticed
EVENTS_IDLE_POLL_MS = 100  # with a cache-event publisher: its heartbeats need the loop


def run_loop(core: EngineCore, cmd_sock: zmq.Socket, out_sock: zmq.Socket,
             parent_pid: int | None = None, publisher: Any = None) -> None:
    """Serve ``core`` until a Shutdown command (or the parent process is gone)."""
    dec = command_decoder()
    enc = command_encoder()
    poller = zmq.Poller()
    poller.register(cmd_sock, zmq.POLLIN)
    idle_ms = IDLE_POLL_MS
    if publisher is not None:
        from radixserve.kv_events import load_of

        poller.register(publisher.socket, zmq.POLLIN)  # a router subscribing wakes the loop
        idle_ms = EVENTS_IDLE_POLL_MS  # heartbeats and load records while idle
    while True:
        busy = core.has_unfinished()
        events = dict(poller.poll(0 if busy else idle_ms))
        outputs: list[ReqDelta] = []
        results: list[CallResult] = []
        stop = False
        if cmd_sock in events:
            while True:
                try:
                    raw = cmd_sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    cmds = dec.decode(raw)
                except Exception as e:  # a malformed message is a bug on the other side
                    log.error("dropping a malformed command message: %s", e)
                    continue
                for cmd in cmds:
                    if isinstance(cmd, Shutdown):
                        stop = True
                    else:
                        _apply(core, cmd, outputs, results)
        if not busy:
            core.cache.poll()  # background results (L3 writes, prefetches) while idle too
            if publisher is not None:
                publisher.poll(core.cache, load_of(core))  # while busy, after every step instead
        if stop:
            return
        if cmd_sock not in events and not busy and parent_pid is not None and os.getppid() != parent_pid:
            log.error("the API process is gone; the engine core exits")
            return
        if core.has_unfinished():
            outputs.extend(core.step())
        if outputs or results:
            out_sock.send(enc.encode(StepOutputs(outputs, results, core.load())))


def _apply(core: EngineCore, cmd: Any, outputs: list[ReqDelta], results: list[CallResult]) -> None:
    if isinstance(cmd, AddRequest):
        try:
            images = images_from_wire(cmd.images) if cmd.images else None
            core.add_request(cmd.rid, cmd.prompt_ids, cmd.params, salt=cmd.salt, arrival=cmd.arrival,
                             session_id=cmd.session_id, images=images,
                             low_priority_from=cmd.low_priority_from)
        except ValueError as e:
            # The API side validated already; answer anyway so the request cannot hang.
            outputs.append(ReqDelta(cmd.rid, finished=True, finish_reason="error", error=str(e)))
    elif isinstance(cmd, Abort):
        for rid in cmd.rids:
            core.abort(rid, cmd.reason)
    elif isinstance(cmd, Call):
        try:
            results.append(CallResult(cmd.call_id, value=core.call(cmd.method, cmd.args)))
        except Exception as e:
            if not isinstance(e, (AssertionError, ValueError, RuntimeError)):
                log.exception("engine call %s failed", cmd.method)
            results.append(CallResult(cmd.call_id, ok=False, error=str(e), error_type=type(e).__name__))


def serve_core(core_factory: Callable[[], EngineCore], ctx: zmq.Context, cmd_addr: str,
               out_addr: str, parent_pid: int | None = None) -> None:
    """Connect to the API side, build the core, say Ready (or Failed), run the loop."""
    cmd_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    cmd_sock.setsockopt(zmq.LINGER, 0)
    out_sock.setsockopt(zmq.LINGER, 1000)
    cmd_sock.connect(cmd_addr)
    out_sock.connect(out_addr)
    enc = command_encoder()
    try:
        try:
            core = core_factory()
        except BaseException as e:  # the API side reports it and exits
            msg = f"{type(e).__name__}: {e}"
            log.error("engine core failed to start: %s\n%s", msg, traceback.format_exc())
            out_sock.send(enc.encode(Failed(msg)))
            return
        publisher = _events_publisher(core)
        out_sock.send(enc.encode(Ready(core.model_info())))
        try:
            run_loop(core, cmd_sock, out_sock, parent_pid, publisher)
        finally:
            if publisher is not None:
                publisher.close()
            core.close()
    finally:
        cmd_sock.close()
        out_sock.close()


def _events_publisher(core: EngineCore) -> Any:
    """The cache-event publisher for a router, when ``kv_events_endpoint`` asks for one:
    every run of tokens entering or leaving the tree goes out once per step, and routers
    that (re)connect get a snapshot consistent with the stream."""
    endpoint = core.config.kv_events_endpoint
    if not endpoint:
        return None
    from radixserve.cache.events import fan_out
    from radixserve.cache.mamba import MambaRadixCache
    from radixserve.cache.swa import SWARadixCache
    from radixserve.kv_events import KVEventPublisher, load_of

    window = core.cache.window if isinstance(core.cache, SWARadixCache) else 0
    pub = KVEventPublisher(endpoint, f"{socket.gethostname()}:{os.getpid()}",
                           page_size=core.config.page_size, window=window,
                           states=isinstance(core.cache, MambaRadixCache))
    core.cache.listener = fan_out(core.cache.listener, pub.publish)  # beside the draft index, if any
    core.step_hooks.append(lambda: pub.poll(core.cache, load_of(core)))
    return pub
