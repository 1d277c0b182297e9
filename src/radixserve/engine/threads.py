"""How many torch threads a step runs on, given what the rest of the machine is doing.

Why: the kernels fork and join their OpenMP threads a few hundred times a decode step, and a
thread that arrives at a join first spins, waiting for the others. When every core has one of
our threads that is the fastest way to run; when another process wants a core too, one of our
threads is descheduled for a whole time slice at some join while its sibling spins, and a step
takes many times longer than on fewer threads (``benchmarks/bench_threads.py`` and
``bench_thread_policy.py`` measure both cases). The thread count does not change a single
bit of the results (every kernel computes an output element with the same chain whichever
thread runs it; ``tests/test_threads.py``), so it can follow the load from step to step.

The measurement: over windows of ``window_s``, the CPU time every process on the machine used
(``/proc/stat``, steal included: a host that takes the vCPUs away is a neighbour too) less
this process's own (its spinning threads included), in cores. The steps run on as many
threads as cores are left free, rounded with hysteresis, between 1 and the configured count.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)

#: /proc/stat's per-CPU fields that are not work: idle and iowait.
_IDLE_FIELDS = (3, 4)


class CpuUsage:
    """CPU seconds used so far by the whole machine and by this process (a source the
    :class:`ThreadGovernor` reads; None from :meth:`machine_busy_s` where /proc/stat is not
    there to read)."""

    def __init__(self, path: str = "/proc/stat"):
        self.path = path
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def machine_busy_s(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != b"cpu":
            return None
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(t for i, t in enumerate(ticks) if i not in _IDLE_FIELDS) / self._hz

    @staticmethod
    def own_s() -> float:
        return time.process_time()


class ThreadGovernor:
    """Sets torch's thread count before a step: ``max_threads`` while the other processes
    leave that many cores free, fewer while they do not (see the module docstring).

    ``free_cores = cores - others``; the target is ``floor(free_cores + slack)`` clamped to
    ``[1, max_threads]``, and the count moves only after ``patience`` windows in a row agree
    on the same target, so one busy moment does not flap it."""

    def __init__(self, max_threads: int, cores: int | None = None, *, window_s: float = 0.5,
                 slack: float = 0.5, patience: int = 2, usage: CpuUsage | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 apply: Callable[[int], None] = torch.set_num_threads):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.cores = cores or os.cpu_count() or 1
        self.window_s = window_s
        self.slack = slack
        self.patience = patience
        self.usage = usage or CpuUsage()
        self.clock = clock
        self._apply = apply
        self.threads = max_threads
        self.changes = 0
        self.others_cores = 0.0  # the last window's measurement
        self._pending: tuple[int, int] | None = None  # (target, windows in a row)
        self._last = self._sample()
        self.enabled = self._last is not None and max_threads > 1

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self.usage.machine_busy_s()
        return None if busy is None else (self.clock(), busy, self.usage.own_s())

    def before_step(self) -> int:
        """The thread count for the step about to run (applied to torch when it changes)."""
        if not self.enabled or self.clock() - self._last[0] < self.window_s:
            return self.threads
        now = self._sample()
        if now is None:
            return self.threads
        wall = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        self.others_cores = others
        target = max(1, min(self.max_threads, int(self.cores - others + self.slack)))
        if target == self.threads:
            self._pending = None
            return self.threads
        count = self._pending[1] + 1 if self._pending and self._pending[0] == target else 1
        self._pending = (target, count)
        if count >= self.patience:
            log.debug("torch threads %d -> %d (other processes used %.2f of %d cores)",
                      self.threads, target, others, self.cores)
            self.threads = target
            self.changes += 1
            self._pending = None
            self._apply(target)
        return self.threads
