"""What ``--dtype auto``'s rule encodes, measured on this machine (not a test).

    python benchmarks/bench_dtype_choice.py [--runs 5] [--hidden 576 --inter 1536] [--cpu-isa avx2]

``radixserve.kernels.dtype_choice`` decides by CPU features alone (bfloat16 wherever the vector
kernels run), so two servers started alike always agree. This prints what that rule stands on:
float32 time / bfloat16 time of a gate/up projection, on the linears ``--linear-backend auto``
gives each dtype, at a decode row count with a model's worth of distinct weights streaming from
memory, and at prefill row counts. Each ratio is the median of interleaved float32/bfloat16
pairs (a noisy neighbour slows both sides of a pair alike); every run's ratios are printed,
so their spread is visible.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.dtype_choice import choose_dtype  # noqa: E402
from radixserve.kernels.linear import make_linears  # noqa: E402

_DECODE_BYTES = 128 << 20  # float32 bytes of distinct weights a decode measurement streams


class Contender:
    """One dtype's linears of one shape, packed as the model would run them."""

    def __init__(self, dtype: torch.dtype, rows: int, in_f: int, out_f: int, cpu_isa: str, copies: int):
        gen = torch.Generator().manual_seed(0)
        self.linears = make_linears("auto", torch.device("cpu"), dtype, cpu_isa)
        w = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype)
        self.weights = [self.linears.pack_for_backend(w) for _ in range(copies)]  # same values, distinct memory
        self.x = torch.randn(rows, in_f, generator=gen).to(self.linears.act_dtype)
        self.run()  # warm

    def run(self) -> float:
        t0 = time.perf_counter()
        for w in self.weights:
            self.linears(self.x, w)
        return time.perf_counter() - t0


def ratio(rows: int, in_f: int, out_f: int, cpu_isa: str, copies: int, reps: int = 7) -> float:
    """float32 time / bfloat16 time, the median over interleaved pairs of runs."""
    f32 = Contender(torch.float32, rows, in_f, out_f, cpu_isa, copies)
    bf16 = Contender(torch.bfloat16, rows, in_f, out_f, cpu_isa, copies)
    ratios = sorted(f32.run() / max(bf16.run(), 1e-12) for _ in range(reps))
    return ratios[len(ratios) // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--cpu-isa", default="auto")
    args = ap.parse_args(argv)
    choice = choose_dtype("auto", "cpu", args.cpu_isa)
    print(f"CPU: {describe()}\n--dtype auto here: {choice.name} ({choice.reason})\n")
    print("| run | decode, 4 rows | prefill, 512 rows | prefill, 2048 rows |")
    print("|---:|---:|---:|---:|")
    copies = max(1, _DECODE_BYTES // (4 * args.hidden * 2 * args.inter))
    out_f = 2 * args.inter
    for i in range(args.runs):
        dec = ratio(4, args.hidden, out_f, args.cpu_isa, copies)
        pre = ratio(512, args.hidden, out_f, args.cpu_isa, 1)
        big = ratio(2048, args.hidden, out_f, args.cpu_isa, 1, reps=3)
        print(f"| {i} | {dec:.2f}x | {pre:.2f}x | {big:.2f}x |", flush=True)
    print("\n(float32 time / bfloat16 time: above 1 bfloat16 is faster)")


if __name__ == "__main__":
    main()
