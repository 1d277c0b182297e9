"""CPU time of the scheduler's own work (no model): ``schedule()`` and ``postprocess()`` over a
seeded trace, with the sampler's rows made up (a fixed token per row).

Trace: ``--requests`` requests over ``--prefixes`` shared prefixes of ``--prefix-len`` tokens
plus a random tail of ``--tail`` tokens, ``--max-tokens`` generated each; all arrive at once
and wait, so admission walks a long queue (LPM orders it at every step). The KV pool is
``--kv`` slots, so requests are admitted as others finish and the tree evicts.

Prints the CPU time (``time.thread_time``, one torch thread) of the whole run, per step and
per request, for ``--rounds`` rounds (median). To compare two checkouts, run this script
under each one's ``PYTHONPATH`` alternately and compare the medians:

    PYTHONPATH=src python benchmarks/bench_scheduler.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from radixserve.cache import RadixCache
from radixserve.config import EngineConfig
from radixserve.memory import SlotAllocator
from radixserve.sampling_params import SamplingParams
from radixserve.sched.batch import SampledRow
from radixserve.sched.scheduler import Scheduler

try:
    from radixserve.request import Req
except ImportError:  # a checkout from before the module was named request.py
    from radixserve.core import Req  # type: ignore[no-redef]


def run(args: argparse.Namespace, seed: int) -> tuple[float, int, int]:
    """One pass over the trace; returns (CPU seconds in the scheduler, steps, requests)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    cfg = EngineConfig(kv_cache_tokens=args.kv, page_size=args.page_size, policy=args.policy,
                       max_running_requests=args.max_running, thread_policy="fixed")
    alloc = SlotAllocator(args.kv, args.page_size)
    cache = RadixCache(args.page_size, on_free=alloc.free)
    sched = Scheduler(cfg, alloc, cache, max_context_len=4096, eos_ids=[0])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        ids = prefixes[rng.randrange(args.prefixes)] + [rng.randrange(1, 32000) for _ in range(args.tail)]
        sched.add(Req(rid=str(i), prompt_ids=ids, params=params))
    steps = 0
    cpu = 0.0
    while sched.num_unfinished:
        t0 = time.thread_time()
        batch = sched.schedule().batch
        if batch is not None:  # the forward would run here; its rows are made up
            sched.postprocess(batch, [SampledRow(7, None, None, None) if s else None for s in batch.sample])
            steps += 1
        cpu += time.thread_time() - t0
    sched.check_integrity()
    return cpu, steps, args.requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--policy", default="lpm")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    times = []
    for r in range(args.rounds):
        cpu, steps, n = run(args, seed=r)
        times.append(cpu)
        print(f"round {r}: {cpu:.3f} s CPU, {steps} steps, {1e6 * cpu / steps:.0f} us/step, "
              f"{1e3 * cpu / n:.2f} ms/request")
    med = statistics.median(times)
    print(f"median: {med:.3f} s CPU ({args.requests} requests, policy {args.policy}, page {args.page_size})")


if __name__ == "__main__":
    main()
