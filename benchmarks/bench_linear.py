"""oneDNN-packed linear weights vs ``F.linear`` on SmolLM2's layer shapes (not a test).

The model packs its linear weights on CPU (``radixserve.model.llama.pack_linear_weights``);
this prints what that buys per row count and dtype, side by side in one process:

    python benchmarks/bench_linear.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.model.llama import _PACK_ROWS_HINT, _packed_linear, packed_linear_supported  # noqa: E402

# (out, in) of SmolLM2-135M's fused qkv, o, gate_up and down projections.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512,2048")
    ap.add_argument("--layers", type=int, default=30, help="copies of each weight (a model's worth)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one pass over "
          f"{args.layers} layers x {len(SHAPES)} projections, best of {args.reps}\n")
    print("| dtype | rows | F.linear ms | packed ms | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        if not packed_linear_supported(torch.device("cpu"), dtype):
            print(f"| {dtype} | – | – | – | no oneDNN | – |")
            continue
        gen = torch.Generator().manual_seed(0)
        dense = [torch.randn(s, generator=gen).mul_(0.05).to(dtype) for _ in range(args.layers) for s in SHAPES]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT) for w in dense]
        for rows in map(int, args.rows.split(",")):
            xs = {s[1]: torch.randn(rows, s[1], generator=gen).to(dtype) for s in SHAPES}
            t_dense = _best(lambda: [F.linear(xs[w.shape[1]], w) for w in dense], args.reps)
            t_packed = _best(lambda: [_packed_linear(xs[w.shape[1]], p) for w, p in zip(dense, packed)],
                             args.reps)
            diff = max((F.linear(xs[w.shape[1]], w).float() - _packed_linear(xs[w.shape[1]], p).float())
                       .abs().max().item() for w, p in zip(dense[:4], packed[:4]))
            print(f"| {str(dtype).replace('torch.', '')} | {rows} | {t_dense * 1e3:.1f} | "
                  f"{t_packed * 1e3:.1f} | {t_dense / t_packed:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
