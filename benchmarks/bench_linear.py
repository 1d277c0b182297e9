"""The model's linear layers against the machine's arithmetic peak (not a test).

    python benchmarks/bench_linear.py [--rows 1,8,32,512,2048] [--threads 1,2]

Prints two tables:

1. Peak FLOP/s of this CPU, measured: independent chains of float32 fused multiply-adds and
   of bf16 pair dot products (``vdpbf16ps``) on every thread (``benchmarks/peak_flops.cpp``,
   built with the kernels' build machinery). Needs AVX-512 (and AVX512-BF16 for the bf16 row).
2. SmolLM2's four projections (fused qkv, o, gate_up, down) over 30 layers, per row count,
   thread count and dtype: ``F.linear`` on dense weights against oneDNN-packed weights
   (``_reorder_linear_weight``) with the batch-size hint the model uses (32) and with the
   hint equal to the row count; GFLOP/s and the share of the measured peak. Results of the
   packed and dense paths agree to the dtype's rounding (max abs diff printed).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.model.layers import _PACK_ROWS_HINT, _packed_linear, packed_linear_supported  # noqa: E402

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


def measured_peaks(threads: int) -> dict[str, float]:
    """{"float32": FLOP/s, "bfloat16": FLOP/s} from benchmarks/peak_flops.cpp (0 if unsupported)."""
    from radixserve.model import kernels

    try:
        lib_path = kernels.build("radixserve_peak", [Path(__file__).with_name("peak_flops.cpp")])
    except kernels.KernelBuildError as e:
        print(f"(peak probe unavailable: {e})")
        return {"float32": 0.0, "bfloat16": 0.0}
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.radixserve_peak_flops
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    return {name: max(fn(bf16, 20_000_000, threads) for _ in range(3))
            for name, bf16 in (("float32", 0), ("bfloat16", 1))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512,2048")
    ap.add_argument("--threads", default=str(torch.get_num_threads()))
    ap.add_argument("--layers", type=int, default=30, help="copies of each weight (a model's worth)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"torch {torch.__version__}; one pass over {args.layers} layers x {len(SHAPES)} "
          f"projections, best of {args.reps}\n")
    peaks = {t: measured_peaks(t) for t in threads}
    print("| threads | float32 FMA peak GFLOP/s | bf16 dot-product peak GFLOP/s |")
    print("|---:|---:|---:|")
    for t, p in peaks.items():
        print(f"| {t} | {p['float32'] / 1e9:.0f} | {p['bfloat16'] / 1e9:.0f} |")
    print()
    print("| dtype | threads | rows | F.linear GFLOP/s | packed (hint 32) GFLOP/s | packed (hint = rows) "
          "GFLOP/s | best / peak | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    before = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        if not packed_linear_supported(torch.device("cpu"), dtype):
            print(f"| {dtype} | – | – | – | no oneDNN | – | – | – |")
            continue
        name = str(dtype).replace("torch.", "")
        gen = torch.Generator().manual_seed(0)
        dense = [torch.randn(s, generator=gen).mul_(0.05).to(dtype) for _ in range(args.layers) for s in SHAPES]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT) for w in dense]
        for t in threads:
            torch.set_num_threads(t)
            for rows in map(int, args.rows.split(",")):
                flops = 2 * rows * sum(o * i for o, i in SHAPES) * args.layers
                xs = {s[1]: torch.randn(rows, s[1], generator=gen).to(dtype) for s in SHAPES}
                hinted = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in dense]
                t_dense = _best(lambda: [F.linear(xs[w.shape[1]], w) for w in dense], args.reps)
                t_packed = _best(lambda: [_packed_linear(xs[w.shape[1]], p) for w, p in zip(dense, packed)],
                                 args.reps)
                t_hint = _best(lambda: [_packed_linear(xs[w.shape[1]], p) for w, p in zip(dense, hinted)],
                               args.reps)
                diff = max((F.linear(xs[w.shape[1]], w).float() - _packed_linear(xs[w.shape[1]], p).float())
                           .abs().max().item() for w, p in zip(dense[:4], packed[:4]))
                peak = peaks[t][name]
                best = flops / min(t_dense, t_packed, t_hint)
                share = f"{best / peak * 100:.0f}%" if peak else "–"
                print(f"| {name} | {t} | {rows} | {flops / t_dense / 1e9:.0f} | {flops / t_packed / 1e9:.0f} "
                      f"| {flops / t_hint / 1e9:.0f} | {share} | {diff:.1e} |")
                del hinted
    torch.set_num_threads(before)


if __name__ == "__main__":
    main()
