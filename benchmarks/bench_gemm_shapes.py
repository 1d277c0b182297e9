"""The bf16 dot-product GEMM against oneDNN's bf16 GEMM, projection by projection (not a test).

    python benchmarks/bench_gemm_shapes.py [--model smollm2-135m] [--rows 512,2048]

For each of the model's projections (fused qkv, o, gate_up, down; their shapes from the
model's config; random weights of those shapes) and each row count: ``Kernels.packed_linear`` on
dot-packed bfloat16 weights with float32 rows in and float32 rows out, as the decoder
layers call it, and oneDNN's bf16 linear (``--linear-backend onednn``: bf16 rows in, bf16
out) on the same values. One thread, each call timed by the thread's CPU time, the two
contenders interleaved, median of ``--reps``; GFLOP/s = 2 M N K / time.
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
from radixserve.kernels.linear import PACK_ROWS_HINT, onednn_linear, onednn_supported  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402


def projections(cfg) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    """(out, in) of each projection a decoder layer runs."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


def median_time(fn, reps: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="512,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kern = load_kernels().capped()
    cfg = load_model(args.model, dtype=torch.bfloat16).config
    onednn = onednn_supported(torch.device("cpu"), torch.bfloat16)
    print(f"CPU: {describe()}; torch {torch.__version__}; our kernels at {kern.isa}; one thread, thread CPU time, "
          f"median of {args.reps}, {args.rounds} interleaved rounds; {args.model}\n")
    print("| projection | rows | ours GFLOP/s | oneDNN bf16 GFLOP/s | oneDNN / ours (rounds) |")
    print("|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in projections(cfg).items():
        w = torch.randn(n, k, generator=gen).mul_(0.05).to(torch.bfloat16)
        ours_w = kern.pack_linear(w, torch.bfloat16, dot=True)
        dnn_w = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) if onednn else None
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen)
            xb = x.to(torch.bfloat16)
            out = torch.empty(rows, n)
            ours_fn = lambda: kern.packed_linear(x, ours_w, out=out)  # noqa: E731
            dnn_fn = lambda: onednn_linear(xb, dnn_w)  # noqa: E731
            ours_fn()
            if onednn:
                dnn_fn()
            flops = 2 * rows * n * k
            ours_t, dnn_t = [], []
            for _ in range(args.rounds):
                ours_t.append(median_time(ours_fn, args.reps))
                if onednn:
                    dnn_t.append(median_time(dnn_fn, args.reps))
            ours = flops / statistics.median(ours_t) / 1e9
            if onednn:
                ratios = [a / b for a, b in zip(ours_t, dnn_t)]
                dnn = flops / statistics.median(dnn_t) / 1e9
                cell = f"{dnn:.0f} | {statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
            else:
                cell = "– | –"
            print(f"| {name} {n}x{k} | {rows} | {ours:.0f} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
