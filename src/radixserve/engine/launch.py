"""Start an engine core — in its own process (the default for ``serve``) or on a thread.

The API side binds two ZMQ sockets (commands out, step outputs in) and the core connects
to them, so a core that dies leaves nothing the API side waits on forever: the client
watches :meth:`CoreHandle.alive` and fails every open request when it turns false.

Why a process: HTTP parsing, validation, tokenization and detokenization run under the API
process's GIL while the core's torch threads compute; in one process the event loop and
the model's OpenMP threads fight over the same cores and the same GIL.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import tempfile
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.config import EngineConfig

log = logging.getLogger("radixserve.engine")


@dataclass
class CoreHandle:
    """A started engine core and the two endpoints its client binds."""

    ctx: zmq.Context
    cmd_addr: str
    out_addr: str
    process: Any = None  # _Proc (a subprocess)
    thread: threading.Thread | None = None
    tmpdir: str | None = None
    cmd_sock: zmq.Socket | None = None  # bound here, used by the client
    out_sock: zmq.Socket | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def kind(self) -> str:
        return "process" if self.process is not None else "thread"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        if self.process is not None and self.process.exitcode is not None:
            code = self.process.exitcode
            if code < 0:
                try:
                    return f"killed by signal {signal.Signals(-code).name}"
                except ValueError:
                    return f"killed by signal {-code}"
            return f"exited with status {code}"
        return "stopped"

    def join(self, timeout: float) -> None:
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                log.warning("engine core did not stop in %.0fs; terminating it", timeout)
                self.process.terminate()
                self.process.join(5)
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join(5)
        elif self.thread is not None:
            self.thread.join(timeout)

    def close(self) -> None:
        """Close the sockets and remove the socket directory (after ``join``)."""
        if self._closed:
            return
        self._closed = True
        for s in (self.cmd_sock, self.out_sock):
            if s is not None:
                s.close(linger=0)
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _bind(ctx: zmq.Context, in_process: bool) -> tuple[zmq.Socket, zmq.Socket, str, str, str | None]:
    cmd, out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (cmd, out):
        s.setsockopt(zmq.LINGER, 0)
    if in_process:
        tag = uuid.uuid4().hex
        cmd_addr, out_addr, tmpdir = f"inproc://rs-cmd-{tag}", f"inproc://rs-out-{tag}", None
    else:
        # A private directory: nobody else on the machine can connect to the core.
        tmpdir = tempfile.mkdtemp(prefix="radixserve-")
        os.chmod(tmpdir, 0o700)
        cmd_addr, out_addr = f"ipc://{tmpdir}/cmd", f"ipc://{tmpdir}/out"
    cmd.bind(cmd_addr)
    out.bind(out_addr)
    return cmd, out, cmd_addr, out_addr, tmpdir


def start_core_process(config: EngineConfig, log_level: str = "info") -> CoreHandle:
    """Start the engine-core process for ``config`` (it loads the model itself): a fresh
    interpreter (``python -m radixserve.engine.launch``) reading its config from stdin, rather
    than multiprocessing's spawn: spawn re-imports the caller's ``__main__``, which a script
    without a main guard does not survive."""
    ctx = zmq.Context.instance()
    cmd, out, cmd_addr, out_addr, tmpdir = _bind(ctx, in_process=False)
    spec = {"config": dataclasses.asdict(config), "cmd": cmd_addr, "out": out_addr,
            "parent": os.getpid(), "log_level": log_level}
    proc = _Proc([sys.executable, "-m", "radixserve.engine.launch"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return CoreHandle(ctx, cmd_addr, out_addr, process=proc, tmpdir=tmpdir, cmd_sock=cmd, out_sock=out)


class _Proc(subprocess.Popen):
    """``subprocess.Popen`` with the multiprocessing-style names the handle uses."""

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.poll()

    def join(self, timeout: float) -> None:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def start_core_thread(core_or_config: Any) -> CoreHandle:
    """Run the core loop on a thread of this process (an EngineCore, or a config to build one)."""
    from radixserve.engine.core import EngineCore
    from radixserve.engine.loop import serve_core

    ctx = zmq.Context.instance()
    cmd, out, cmd_addr, out_addr, _ = _bind(ctx, in_process=True)
    built = isinstance(core_or_config, EngineCore)
    factory = lambda: core_or_config if built else EngineCore(core_or_config)  # noqa: E731
    t = threading.Thread(target=serve_core, args=(factory, ctx, cmd_addr, out_addr),
                         name="radixserve-core", daemon=True)
    t.start()
    return CoreHandle(ctx, cmd_addr, out_addr, thread=t, cmd_sock=cmd, out_sock=out)


def _last_words(out_addr: str, reason: str) -> None:
    """Send the API side why this core is about to exit. A context of its own, terminated
    before returning: ``term()`` blocks until the message is handed over (or the linger runs
    out), whereas the process exits with ``os._exit`` right after, which would kill a shared
    context's I/O thread with the message still queued. A socket of the calling thread, too:
    the loop's own belongs to the main thread, which may be stuck in a collective."""
    from radixserve.engine.messages import StepOutputs, command_encoder

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(out_addr)
        sock.send(command_encoder().encode(StepOutputs(fatal=reason)))
    finally:
        sock.close()
        ctx.term()


def _core_process_main() -> None:
    """Entry point of the engine-core process: the spec comes on stdin as JSON."""
    spec = json.loads(sys.stdin.buffer.read())
    # Ctrl-C reaches the whole process group: the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    from radixserve.engine.core import EngineCore
    from radixserve.engine.loop import serve_core

    ctx = zmq.Context()
    try:
        config = EngineConfig(**spec["config"])

        def make_core() -> EngineCore:
            # A failed tensor-parallel rank ends this process, after telling the API side
            # why (it then answers 503 with that reason).
            core = EngineCore(config, exit_on_tp_failure=True)
            if core.tp is not None:
                core.tp.fatal_hooks.append(lambda reason: _last_words(spec["out"], reason))
            return core

        serve_core(make_core, ctx, spec["cmd"], spec["out"], spec["parent"])
    finally:
        ctx.destroy(linger=1000)


if __name__ == "__main__":
    _core_process_main()
