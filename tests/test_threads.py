"""The adaptive thread count (radixserve.engine.threads): the same bits on any thread count,
the rule that picks the count, and a real neighbour process making it drop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from cpu_paths import require_kernels
from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.threads import CpuUsage, ThreadGovernor


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_thread_count_changes_no_bit(restore_threads, smollm2_loaded, dtype):
    """Tokens and logprobs (seeded sampling, a batch of prompts of different lengths) on one
    thread equal those on two and on the adaptive policy: so the count may follow the load.
    SmolLM2, not a tiny model: its matmuls and attention are big enough to be split over threads."""
    require_kernels()
    prompts = [[3 + (i * 7 + j * 13) % 40000 for j in range(n)] for i, n in enumerate((5, 40, 130, 260))]
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, logprobs=True, top_logprobs=2)
              for i in range(len(prompts))]
    outs = {}
    for threads, policy in ((1, "fixed"), (2, "fixed"), (2, "adaptive")):
        eng = Engine(smollm2_loaded, dtype=dtype, num_threads=threads, thread_policy=policy, kv_cache_tokens=2048)
        assert torch.get_num_threads() == threads
        got = eng.generate(prompts, params)
        outs[(threads, policy)] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in got]
        del eng
    assert outs[(1, "fixed")][0][1]  # logprobs were returned
    assert outs[(1, "fixed")] == outs[(2, "fixed")] == outs[(2, "adaptive")]


class _Script(CpuUsage):
    """A machine whose other processes use ``others[i]`` cores in window i."""

    def __init__(self, others: list[float], window: float):
        self.others, self.window = others, window
        self.i = 0
        self.busy = 0.0

    def machine_busy_s(self) -> float:
        return self.busy

    def own_s(self) -> float:
        return 0.0

    def advance(self) -> None:
        self.busy += self.others[self.i] * self.window
        self.i += 1


def _run(others: list[float], max_threads: int, cores: int, patience: int = 2) -> list[int]:
    t = [0.0]
    usage = _Script(others, 1.0)
    applied: list[int] = []
    gov = ThreadGovernor(max_threads, cores, window_s=1.0, patience=patience, usage=usage,
                         clock=lambda: t[0], apply=applied.append)
    seen = []
    for _ in others:
        t[0] += 1.0
        usage.advance()
        seen.append(gov.before_step())
    assert applied == [b for a, b in zip([max_threads] + seen, seen) if a != b]  # torch told every change
    return seen


def test_the_rule_takes_the_cores_other_processes_leave():
    # A core counts as free while others use less than half of it; changes wait for two windows.
    assert _run([0.0, 0.2, 0.45, 0.3], 2, 2) == [2, 2, 2, 2]
    assert _run([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], 2, 2) == [2, 1, 1, 1, 2, 2]
    assert _run([0.6, 0.6, 0.0, 0.6, 0.0], 2, 2) == [2, 1, 1, 1, 1]  # one quiet window is not enough
    assert _run([3.0, 3.0, 5.0, 5.0], 4, 4) == [4, 1, 1, 1]
    assert _run([1.6, 1.6, 0.0, 0.0], 8, 4) == [8, 2, 2, 4]  # more threads than cores: never back above cores
    assert _run([2.0, 2.0, 2.0], 1, 2) == [1, 1, 1]  # nothing to give up at one thread


def test_a_governor_without_proc_stat_keeps_the_configured_count(tmp_path):
    usage = CpuUsage(str(tmp_path / "missing"))
    gov = ThreadGovernor(2, 2, usage=usage, apply=lambda n: pytest.fail("changed threads"))
    assert not gov.enabled and gov.before_step() == 2
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0)
    with pytest.raises(ValueError, match="thread_policy"):
        EngineConfig(thread_policy="sometimes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_real_neighbour_takes_the_threads_down(restore_threads):
    """Processes spinning on every core: the governor measures them and drops to one thread."""
    cores = os.cpu_count() or 2
    applied: list[int] = []
    gov = ThreadGovernor(2, cores, window_s=0.2, apply=applied.append)
    assert gov.enabled
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        end = time.monotonic() + 5.0
        while time.monotonic() < end and gov.threads != 1:
            gov.before_step()
            time.sleep(0.02)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert gov.threads == 1 and applied == [1], (gov.others_cores, applied)
