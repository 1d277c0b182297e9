"""gate_up and its gate in one pass against the two passes it replaces, the kernel alone (not a test).

    python benchmarks/bench_gated_linear.py [--shape 576x1536] [--rows 1,8,512,2048] [--rounds 5]

``Kernels.gated_linear`` on a dense bfloat16 gate_up weight (packed for the dot products) with
``fuse=True`` (the gate on the GEMM's tiles while they are in cache) and ``fuse=False`` (the GEMM
writes its float32 ``[M, 2 I]`` rows, SiLU·mul reads them back): the same bits, so only the
time differs. One thread, timed by its CPU time; each round times both in turn, and the table
prints each round's ratio two-pass / one-pass (above 1: the one pass is faster). ``--shape``
is ``KxI`` (SmolLM2: 576x1536; Gemma 3 270M: 640x2048).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.library import load_kernels  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="576x1536", help="KxI: the rows' width and the intermediate size")
    ap.add_argument("--rows", default="1,8,512,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gate", default="silu", choices=("silu", "gelu_tanh"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    k = load_kernels()
    kk, inter = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    w = k.pack_linear(torch.randn(2 * inter, kk, generator=gen) * 0.05, torch.bfloat16, dot=True)
    print(f"CPU: {describe()}; torch {torch.__version__}, 1 thread, thread CPU time; gate_up [{2 * inter}, {kk}] "
          f"bf16 dot products, {args.gate}\n")
    print("| rows | one pass us | two passes us | GFLOP/s one pass | two / one (rounds) |")
    print("|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, kk, generator=gen)
        out = torch.empty(m, inter)
        gu = torch.empty(m, 2 * inter)  # the two passes' rows, allocated once (as the layers' buffers are)
        reps = max(3, 4000 // m)
        spent: dict[bool, list[float]] = {True: [], False: []}
        for fuse in (True, False):  # warm both
            k.gated_linear(x, w, args.gate, out=out, fuse=fuse, gu=gu)
        for _ in range(args.rounds):
            for fuse in (True, False):
                t0 = time.thread_time()
                for _ in range(reps):
                    k.gated_linear(x, w, args.gate, out=out, fuse=fuse, gu=gu)
                spent[fuse].append((time.thread_time() - t0) / reps)
        one, two = statistics.median(spent[True]), statistics.median(spent[False])
        per = [b / a for a, b in zip(spent[True], spent[False])]
        flops = 2 * m * 2 * inter * kk
        print(f"| {m} | {one * 1e6:.1f} | {two * 1e6:.1f} | {flops / one / 1e9:.0f} | "
              f"{statistics.median(per):.3f} ({', '.join(f'{r:.3f}' for r in per)}) |")


if __name__ == "__main__":
    main()
