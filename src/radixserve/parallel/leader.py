"""Rank 0's side of a tensor-parallel group: start the workers, send them every step, stop.

The engine core that schedules is rank 0. :class:`TPLeader` (built by the core when
``tp_size > 1``) starts the workers of this machine as child processes, waits until every
rank — local or started by another machine's ``radixserve serve --node-rank K`` — has
connected and built its shard, and from then on sends each forward pass to all of them
(:meth:`forward`), runs its own shard, and gets the logits back.

Failure: the first failure of any rank (seen by the watch thread, or by a collective that
breaks) stops the whole group — the local workers are killed at once, so nothing waits in
a collective, and remote workers exit when their connection to rank 0 closes. In the
engine-core process (``exit_on_failure=True``) rank 0 then exits with status 1 after
logging which rank failed and why; the API process sees its core gone and answers 503. In
a process that embeds the engine (``Engine(..., tp_size=N)``) the next step raises
:class:`TPFailure` instead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from radixserve.config import EngineConfig
from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.parallel import rendezvous as rdv
from radixserve.parallel.comm import TPComm, TPFailure
from radixserve.parallel.shard_model import LM_HEAD_MODES, build_shard_model, weights_fingerprint
from radixserve.parallel.sharding import plan_shards
from radixserve.parallel.watchdog import LeaderWatch
from radixserve.parallel.wire import FLAG_SKIP_LOGITS, OP_CHECK, OP_SHUTDOWN, BatchDigest, encode_forward, header

LOCAL_STARTUP_S = 120.0  # the least rank 0 waits for ranks it spawned on this node

log = logging.getLogger("radixserve.parallel")


LAST_WORDS_WAIT_S = 5.0  # how long a second failing thread waits for the first to exit

class TPLeader:
    """Rank 0 of a tensor-parallel group of ``config.tp_size`` ranks."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                 exit_on_failure: bool = False, lm_head: str = "vocab"):
        if config.node_rank != 0:
            raise ValueError(f"rank 0 runs on node 0, not node_rank {config.node_rank}")
        if lm_head not in LM_HEAD_MODES:
            raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
        self.config = config
        self.size = config.tp_size
        self.plan = plan_shards(model_config, self.size)  # ValueError before starting anything
        self.model_config = model_config
        self.dtype = dtype
        self.lm_head = lm_head
        self.exit_on_failure = exit_on_failure
        # Called with the reason before the process exits on a failure (exit_on_failure):
        # the engine-core process tells the API side why.
        self.fatal_hooks: list[Callable[[str], None]] = []
        self.device = rdv.rank_device(config.device, 0)
        self.steps = 0
        self.digest = BatchDigest()
        self.failure: str | None = None
        self.closed = False
        self.ready = False  # startup done: failures from now on may exit the process
        self.procs: dict[int, subprocess.Popen] = {}
        self._fail_lock = threading.Lock()
        self.comm: TPComm | None = None
        self._store, host, port, self._listener = rdv.open_master_store(config)
        loopback = config.nnodes == 1
        try:
            bind = host if loopback else ("::" if ":" in host else "0.0.0.0")
            self.watch = LeaderWatch(bind, host, self.size, self._on_failure)
            self._store.set(rdv.WATCH_KEY, self.watch.address)
            level = rdv.log_level_name()
            for rank in rdv.node_ranks(config, 0)[1:]:
                spec = rdv.worker_spec(config, rank, host, port, dtype, os.getpid(), level, lm_head)
                self.procs[rank] = proc = rdv.spawn_worker(spec)
                self.watch.add_process(rank, proc)
            peers = self.watch.wait_for("hello", self._startup_timeout())
            mine = rdv.shared_options(config)
            for rank, peer in sorted(peers.items()):
                bad = rdv.mismatches(mine, peer.hello.get("options", {}))
                if bad:
                    raise TPFailure(f"{self.watch.describe(rank)} was started with other options than "
                                    f"rank 0: {', '.join(bad)}")
            self.comm = self._in_thread(lambda: TPComm(self._store, 0, self.size, self.device,
                                                       config.dist_timeout_s, loopback=loopback),
                                        "building the process group")
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ startup
    def _startup_timeout(self) -> float:
        """How long rank 0 waits for the others to connect and load. On one node every rank
        is a process rank 0 spawned and watches (one that dies fails the wait at once), so
        the wait only has to outlast a slow start on a busy machine: at least
        ``LOCAL_STARTUP_S``. Ranks on other nodes get ``dist_timeout_s``, as collectives do."""
        cfg = self.config
        return cfg.dist_timeout_s if cfg.nnodes > 1 else max(cfg.dist_timeout_s, LOCAL_STARTUP_S)

    def build_model(self, state_dict: Mapping[str, torch.Tensor], pack_weights: bool | None = None
                    ) -> LlamaForCausalLM:
        """Rank 0's shard of the model (the other ranks build theirs meanwhile)."""
        assert self.comm is not None
        return build_shard_model(self.model_config, state_dict, self.plan[0], self.comm,
                                 dtype=self.dtype, device=self.device, pack_weights=pack_weights,
                                 lm_head=self.lm_head, cpu_isa=self.config.cpu_isa,
                                 linear_backend=self.config.linear_backend)

    def wait_ready(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Wait until every worker has built its shard; check they loaded the same weights."""
        try:
            mine = weights_fingerprint(state_dict)
            peers = self.watch.wait_for("ready", self._startup_timeout())
            for rank, peer in sorted(peers.items()):
                theirs = (peer.ready or {}).get("fingerprint")
                if theirs != mine:
                    raise TPFailure(f"{self.watch.describe(rank)} loaded other weights than rank 0 for "
                                    f"model {self.config.model!r} (fingerprint {theirs} vs {mine})")
            self.check()  # one round trip through every rank: the group works
        except BaseException:
            self.shutdown()
            raise
        self.ready = True
        log.info("tensor parallelism: %d ranks ready (heads per rank %s, KV heads per rank %s)",
                 self.size, [s.num_heads for s in self.plan], [s.num_kv_heads for s in self.plan])

    def _in_thread(self, fn: Callable[[], Any], what: str) -> Any:
        """Run a call that blocks until every rank joins, on a helper thread, so a rank that
        dies meanwhile ends the wait at once instead of after the timeout."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e

        t = threading.Thread(target=run, name="radixserve-tp-init", daemon=True)
        t.start()
        deadline = time.monotonic() + self.config.dist_timeout_s
        while t.is_alive():
            t.join(0.1)
            if self.failure is not None:
                raise TPFailure(self.failure)
            if time.monotonic() > deadline:
                raise TPFailure(f"{what} took longer than {self.config.dist_timeout_s:.0f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # ------------------------------------------------------------------ steps
    def forward(self, model: LlamaForCausalLM, fb: ForwardBatch, kv_pool: KVPool,
                attn: AttentionBackend) -> ForwardOutput:
        """Send the step to every rank, run rank 0's shard; any failure is fatal
        (the ranks would be out of step)."""
        self._check_alive()
        assert self.comm is not None
        step = self.steps + 1
        flags = FLAG_SKIP_LOGITS if self.lm_head == "rank0" else 0
        hdr, payload = encode_forward(fb, step, flags)
        try:
            self.comm.broadcast(hdr)
            self.comm.broadcast(payload)
            out = model.forward(fb, kv_pool, attn)
        except BaseException as e:
            raise self._fatal(f"the forward pass of step {step} failed on TP rank 0: "
                              f"{type(e).__name__}: {e}") from e
        self.digest.update(step, payload, fb.num_seqs)
        self.steps = step
        return out

    def check(self) -> dict[str, Any]:
        """Every rank's (steps, digest of the slots its forwards used); AssertionError unless
        they are all equal to rank 0's."""
        self._check_alive()
        assert self.comm is not None
        try:
            self.comm.broadcast(header(OP_CHECK, self.steps))
            got = self.comm.all_gather_ints([self.digest.steps, self.digest.value()])
        except BaseException as e:
            raise self._fatal(f"the consistency check failed: {type(e).__name__}: {e}") from e
        if any(v != got[0] for v in got):
            raise AssertionError("tensor-parallel ranks disagree on the slots their forward passes used: "
                                 + "; ".join(f"rank {r}: {v[0]} steps, digest {v[1]:016x}" for r, v in enumerate(got)))
        return {"tp_size": self.size, "steps": got[0][0], "slot_digest": f"{got[0][1] & (2**64 - 1):016x}"}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tp_size": self.size, "steps": self.steps,
                               "heads_per_rank": [s.num_heads for s in self.plan],
                               "kv_heads_per_rank": [s.num_kv_heads for s in self.plan],
                               "lm_head": self.lm_head}
        if self.comm is not None:
            out["comm"] = self.comm.stats.as_dict()
        return out

    # ------------------------------------------------------------------ failure and shutdown
    def alive(self) -> bool:
        return self.failure is None and not self.closed

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise TPFailure(self.failure)
        if self.closed:
            raise TPFailure("the tensor-parallel group was shut down")

    def _fatal(self, reason: str) -> TPFailure:
        """A collective or the forward broke: prefer the watch's explanation (which rank
        died) when it arrives within a moment, then fail the group."""
        deadline = time.monotonic() + 2.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._on_failure(self.failure or reason)
        return TPFailure(self.failure or reason)

    def _on_failure(self, reason: str) -> None:
        with self._fail_lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if not first:
            if self.exit_on_failure and self.ready and not self.closed:
                # The first caller is telling the API side why and then ends the process;
                # returning would let this thread's exception end it first, unexplained.
                threading.Event().wait(LAST_WORDS_WAIT_S)
            return
        log.error("tensor parallelism: %s; stopping all ranks", reason)
        self._kill_local()
        if self.exit_on_failure and self.ready and not self.closed:
            # The engine-core process: nothing may wait on a collective that cannot finish.
            for hook in self.fatal_hooks:
                try:
                    hook(f"tensor parallelism: {reason}")
                except Exception:  # the exit below matters more
                    log.exception("tensor parallelism: a failure hook failed")
            logging.shutdown()
            os._exit(1)

    def _kill_local(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank (idempotent). After a failure the local workers are already gone."""
        if self.closed:
            return
        self.closed = True
        clean = self.failure is None and self.ready and self.comm is not None
        if clean:
            try:
                self.comm.broadcast(header(OP_SHUTDOWN, self.steps))
            except TPFailure as e:
                log.warning("tensor parallelism: shutdown message not delivered: %s", e)
                clean = False
        if not clean:  # startup failed or a rank failed: nothing to wait for
            self._kill_local()
        watch = getattr(self, "watch", None)
        if watch is not None:
            watch.close(bye=clean)
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("TP rank %d (pid %d) did not stop in %.0fs; killing it", rank, proc.pid, timeout)
                proc.kill()
                proc.wait(5)
        self.comm = None
        self._store = None  # type: ignore[assignment]
        try:
            self._listener.close()
        except OSError:
            pass

