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
import traceback
from typing import Any, Callable

import zmq

from radixserve.engine.core import EngineCore
from radixserve.engine.messages import (
    Abort, AddRequest, Call, CallResult, Failed, Ready, ReqDelta, Shutdown, StepOutputs,
    command_decoder, command_encoder,
)

log = logging.getLogger("radixserve.engine")

IDLE_POLL_MS = 1000  # blocking wait while idle; bounds how late a dead parent is noticed


def run_loop(core: EngineCore, cmd_sock: zmq.Socket, out_sock: zmq.Socket,
             parent_pid: int | None = None, poll_hooks: list[Callable[[], None]] | None = None) -> None:
    """Serve ``core`` until a Shutdown command (or the parent process is gone)."""
    dec = command_decoder()
    enc = command_encoder()
    poller = zmq.Poller()
    poller.register(cmd_sock, zmq.POLLIN)
    hooks = poll_hooks or []
    while True:
        busy = core.has_unfinished()
        events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
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
        for hook in hooks:
            hook()
        if stop:
            return
        if not events and not busy and parent_pid is not None and os.getppid() != parent_pid:
            log.error("the API process is gone; the engine core exits")
            return
        if core.has_unfinished():
            outputs.extend(core.step())
        if outputs or results:
            out_sock.send(enc.encode(StepOutputs(outputs, results, core.load())))


def _apply(core: EngineCore, cmd: Any, outputs: list[ReqDelta], results: list[CallResult]) -> None:
    if isinstance(cmd, AddRequest):
        try:
            core.add_request(cmd.rid, cmd.prompt_ids, cmd.params, salt=cmd.salt, arrival=cmd.arrival)
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
        hooks: list[Callable[[], None]] = []
        publisher = _events_publisher(core)
        if publisher is not None:
            hooks.append(publisher.poll)
        out_sock.send(enc.encode(Ready(core.model_info())))
        try:
            run_loop(core, cmd_sock, out_sock, parent_pid, hooks)
        finally:
            core.close()
    finally:
        cmd_sock.close()
        out_sock.close()


def _events_publisher(core: EngineCore) -> Any:
    """The cache-event publisher for a router, when ``kv_events_endpoint`` asks for one."""
    endpoint = core.config.kv_events_endpoint
    if not endpoint:
        return None
    from radixserve.kv_events import attach_publisher  # noqa: PLC0415 (optional feature)

    return attach_publisher(core, endpoint)
