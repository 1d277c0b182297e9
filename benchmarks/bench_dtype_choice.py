"""How stable ``--dtype auto`` is on this machine (not a test): the startup measurement of
``radixserve.engine.dtype_choice`` repeated, each ratio and the choice it gives printed.

    python benchmarks/bench_dtype_choice.py [--runs 10] [--hidden 1024 --inter 2048]

A server measures once at startup; a rule whose bar sits inside the spread of these ratios
picks different dtypes on different starts of the same machine (bfloat16 vs float32 decode
differ ~2x where the weights stream from memory). The default shape is the one a server
measures (the model is not loaded yet then).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.cpu import describe, native_bf16  # noqa: E402
from radixserve.engine import dtype_choice  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--cpu-isa", default="auto")
    args = ap.parse_args(argv)
    print(f"CPU: {describe()}; bars: decode >= {dtype_choice._MIN_DECODE_SPEEDUP}x, "
          f"prefill >= {dtype_choice._MIN_PREFILL_RATIO}x\n")
    print("| run | decode ratio (4 rows) | prefill ratio (512 rows) | choice |")
    print("|---:|---:|---:|---|")
    copies = max(1, dtype_choice._DECODE_BYTES // (4 * args.hidden * 2 * args.inter))
    picks = []
    for i in range(args.runs):
        dec = dtype_choice._ratio(4, args.hidden, 2 * args.inter, args.cpu_isa, copies)
        pre = dtype_choice._ratio(512, args.hidden, 2 * args.inter, args.cpu_isa, 1)
        choice = dtype_choice.decide(dec, pre, "")
        picks.append(choice.name)
        print(f"| {i} | {dec:.2f} | {pre:.2f} | {choice.name} |")
    how = "native bf16" if native_bf16(args.cpu_isa) else "bf16 weights, float32 compute"
    print(f"\n{how}: {picks.count('bfloat16')} of {len(picks)} runs pick bfloat16")


if __name__ == "__main__":
    main()
