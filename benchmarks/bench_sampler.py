"""The sampler's cost per decode step, beside torch.multinomial's draw (not a test).

    python benchmarks/bench_sampler.py [--rounds 5] [--reps 20]

For SmolLM2's (49,152) and Gemma 3's (262,144) vocabularies and 1 or 8 rows: the time of one
``Sampler.sample`` call, greedy and seeded at temperature 0.8, and the time of what the seeded
draw replaced (a softmax and one ``torch.multinomial`` per row with the row's generator).
One thread, the thread's CPU time, median of ``--reps`` calls; the rounds alternate the
contenders so a noisy neighbour hits both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.engine.sampler import Sampler
from radixserve.kernels.isa import describe
from radixserve.sampling_params import SamplingParams


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# CPU: {describe()}; torch {torch.__version__}; one thread, ms per call (thread CPU time)")
    print("| vocabulary | rows | greedy sample() | seeded sample() | softmax + multinomial per row | multinomial / sample() |")
    print("|---:|---:|---:|---:|---:|---:|")
    for vocab in (49_152, 262_144):
        for rows in (1, 8):
            med = measure(vocab, rows, args.rounds, args.reps)
            print(f"| {vocab:,} | {rows} | {med['greedy']:.2f} | {med['seeded']:.2f} "
                  f"| {med['multinomial']:.2f} | {med['multinomial'] / med['seeded']:.1f}x |")


def measure(vocab: int, rows: int, rounds: int, reps: int) -> dict[str, float]:
    """Median ms per call of the three contenders on ``rows`` rows of random logits."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    s = Sampler(vocab)
    greedy = [SamplingParams(temperature=0.0)] * rows
    seeded = [SamplingParams(temperature=0.8)] * rows
    gens = [s.make_generator(i) for i in range(rows)]
    empty = [[]] * rows

    def multinomial() -> None:
        probs = torch.softmax(logits / 0.8, dim=-1)
        for j in range(rows):
            torch.multinomial(probs[j], 1, generator=gens[j])

    out: dict[str, list[float]] = {"greedy": [], "seeded": [], "multinomial": []}
    for _ in range(rounds):
        out["greedy"].append(timed(lambda: s.sample(logits, greedy, empty, empty, [None] * rows), reps))
        out["seeded"].append(timed(lambda: s.sample(logits, seeded, empty, empty, gens), reps))
        out["multinomial"].append(timed(multinomial, reps))
    return {k: statistics.median(v) for k, v in out.items()}

if __name__ == "__main__":
    main()
