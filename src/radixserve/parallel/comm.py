"""The collectives of one tensor-parallel group, without torch.distributed's global state.

Two process groups over one store: gloo for the control plane (the step broadcast, the
consistency check) and, for the model's activations, the same gloo group on CPU or an NCCL
group on CUDA. They are built as standalone objects (``ProcessGroupGloo(store, rank,
size)``) rather than with ``init_process_group``, so a process can hold several groups (two
engines in one test process, a data-parallel server of tensor-parallel cores) and nothing
global is left behind when one goes.

Every collective raises :class:`TPCommError` on failure — a peer that died closes its
sockets, so a pending gloo operation fails at once; one that hangs is cut off by the
group's timeout. Either way the group is unusable afterwards (gloo closes the pair), which
is why the callers treat any failure as fatal for the whole group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


class TPFailure(RuntimeError):
    """The tensor-parallel group is broken (a rank died, hung or failed): the engine stops."""


class TPCommError(TPFailure):
    """A collective failed."""


@dataclass
class CommStats:
    """Time and bytes per kind of collective, as seen by this rank (waiting for a slower
    rank counts as time: that is what the step pays)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, dt: float, nbytes: int) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + dt
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: {"seconds": self.seconds[k], "calls": self.calls[k], "bytes": self.bytes[k]}
                for k in sorted(self.seconds)}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.bytes.clear()


# How long a worker may wait for rank 0's next step: idle servers wait as long as they
# like (rank 0's death is noticed by the watchdog and by the broken connection, not by this).
IDLE_WAIT = timedelta(days=365)


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                loopback: bool) -> dist.ProcessGroupGloo:
    """A gloo group; ``loopback``: all ranks on this machine, so its sockets listen on
    127.0.0.1 only (by default gloo uses the host's address, reachable from the network)."""
    if loopback and hasattr(dist.ProcessGroupGloo, "_Options"):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class TPComm:
    """Collectives of rank ``rank`` in a group of ``size`` (built by every rank together:
    the constructor returns once all of them have connected)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float, loopback: bool = False):
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.stats = CommStats()
        try:
            self.cpu_group = _gloo_group(dist.PrefixStore("gloo/", store), rank, size, self.timeout, loopback)
            if device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
            else:
                self.device_group = self.cpu_group
        except RuntimeError as e:
            raise TPCommError(f"TP rank {rank}: building the process group failed: {e}") from e
        self._allreduce_opts = dist.AllreduceOptions()
        self._gather_opts = dist.GatherOptions()
        self._gather_opts.rootRank = 0

    def _fail(self, what: str, e: BaseException) -> TPCommError:
        hint = ""
        if "timed out" in str(e).lower():
            hint = (f" (no answer within dist_timeout_s={self.timeout.total_seconds():g}s: "
                    "another rank hung or is overloaded)")
        return TPCommError(f"TP rank {self.rank}: {what} failed{hint}: {e}")

    # ------------------------------------------------------------------ model hooks
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (the row-parallel o_proj / down_proj outputs)."""
        t = t.contiguous()
        t0 = time.perf_counter()
        try:
            self.device_group.allreduce([t], self._allreduce_opts).wait()
        except RuntimeError as e:
            raise self._fail("all-reduce", e) from e
        self.stats.add("all_reduce", time.perf_counter() - t0, t.numel() * t.element_size())
        return t

    def gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """Rank 0 gets every rank's ``[rows, cols]`` block side by side, cut to ``width``
        columns (the vocabulary-parallel lm_head's logits); other ranks get ``t`` back."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        t0 = time.perf_counter()
        try:
            self.device_group.gather([parts] if self.rank == 0 else [], [t], self._gather_opts).wait()
        except RuntimeError as e:
            raise self._fail("logits gather", e) from e
        self.stats.add("gather", time.perf_counter() - t0, t.numel() * t.element_size())
        if self.rank != 0:
            return t
        out = torch.cat(parts, dim=1)
        return out if out.shape[1] == width else out[:, :width].contiguous()

    # ------------------------------------------------------------------ control plane
    def broadcast(self, t: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's CPU ``t`` into every rank's ``t`` (int64 step messages). ``idle``: the
        wait for the next step, which may last as long as the server is idle."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if idle:
            opts.timeout = IDLE_WAIT
        t0 = time.perf_counter()
        try:
            self.cpu_group.broadcast([t], opts).wait()
        except RuntimeError as e:
            raise self._fail("step broadcast", e) from e
        if not idle or self.rank == 0:
            self.stats.add("broadcast", time.perf_counter() - t0, t.numel() * t.element_size())
        return t

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            self.cpu_group.allgather([out], [mine]).wait()
        except RuntimeError as e:
            raise self._fail("all-gather", e) from e
        return [o.tolist() for o in out]
