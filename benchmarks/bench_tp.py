"""Tensor-parallel step time: TP 1 (two threads in one rank) vs TP 2 (one thread per rank).

Prints a markdown table. Not a test. Run:  ``python benchmarks/bench_tp.py [--model M] [--reps N]``

What is measured, and how:

* One engine per configuration, float32 by default, built as the server builds it
  (``Engine(model, tp_size=N, num_threads=T)``): TP 1 with ``T = 2``, TP 2 with ``T = 1`` per
  rank, so both use the same two cores. The step is ``runner.forward(ForwardBatch)`` on rank 0,
  which for TP 2 includes broadcasting the batch to rank 1, both shards' forwards, the two
  all-reduces per layer and the logits gather. Sampling is not included (it runs on rank 0
  alone, the same in both).
* prefill 512: one prompt of 512 tokens, logits of the last one. decode B: B sequences with a
  256-token context each (K/V slots of the pool; their content does not change the cost),
  one new token each.
* TP 1 with one thread is shown too: the cost of one rank's work without the second core.
* The median of ``--reps`` steps after two warm-up steps; the all-reduce, gather and
  broadcast columns are rank 0's time inside those collectives per step (waiting for the
  slower rank counts: that is what the step pays), also medians.

On a shared 2-core CPU the numbers are noisy and TP 2 is expected to lose: the two ranks
already share the cores TP 1 uses as threads, and every layer adds two synchronisations.
What TP buys on several devices is memory (each holds 1/N of the weights and of the KV
cache) and bandwidth (decode reads 1/N of the weights per device), against 2 all-reduces
of ``tokens x hidden`` per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from radixserve import Engine
from radixserve.model.arch.forward_batch import ForwardBatch

CONTEXT = 256


def _prefill(n: int) -> ForwardBatch:
    return ForwardBatch.build([[(7 * i) % 500 + 3 for i in range(n)]], [0], [torch.arange(n)])


def _decode(batch: int) -> ForwardBatch:
    span = CONTEXT + 1
    return ForwardBatch.build([[5 + b] for b in range(batch)], [CONTEXT] * batch,
                              [torch.arange(b * span, (b + 1) * span) for b in range(batch)])


def measure(engine: Engine, make: Any, reps: int) -> dict[str, float]:
    tp = engine.core.tp
    steps: list[float] = []
    comm: dict[str, list[float]] = {"all_reduce": [], "gather": [], "broadcast": []}
    for i in range(reps + 2):
        fb = make()
        if tp is not None and tp.comm is not None:
            tp.comm.stats.reset()
        t0 = time.perf_counter()
        engine.runner.forward(fb)
        dt = time.perf_counter() - t0
        if i < 2:
            continue
        steps.append(dt)
        if tp is not None and tp.comm is not None:
            for k, seconds in comm.items():
                seconds.append(tp.comm.stats.seconds.get(k, 0.0))
    out = {"step": statistics.median(steps)}
    out.update({k: statistics.median(v) for k, v in comm.items() if v})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cases = [("prefill 512", lambda: _prefill(512))] + [
        (f"decode B={b}", (lambda b=b: _decode(b))) for b in batches]
    capacity = max(512, max(batches) * (CONTEXT + 1)) + 64
    results: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
    for tp, threads in ((1, 2), (2, 1), (1, 1)):
        eng = Engine(args.model, dtype=args.dtype, tp_size=tp, num_threads=threads,
                     kv_cache_tokens=capacity)
        try:
            results[tp, threads] = {name: measure(eng, make, args.reps) for name, make in cases}
            if tp == 2:
                s = eng.stats()["tp"]
                heads = f"heads per rank {s['heads_per_rank']}, KV heads {s['kv_heads_per_rank']}"
        finally:
            eng.close()
    print(f"\nmodel {args.model} ({args.dtype}), {args.reps} reps, median ms per step; TP 2: {heads}\n")
    print("| step | TP1 (2 threads) | TP2 (1 thread/rank) | TP2/TP1 | all-reduce | gather | broadcast "
          "| TP1 (1 thread) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, _ in cases:
        a, b, c = results[1, 2][name], results[2, 1][name], results[1, 1][name]
        print(f"| {name} | {a['step'] * 1e3:.1f} | {b['step'] * 1e3:.1f} | {b['step'] / a['step']:.2f} | "
              f"{b['all_reduce'] * 1e3:.1f} | {b['gather'] * 1e3:.1f} | {b['broadcast'] * 1e3:.2f} | "
              f"{c['step'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
