"""The model's linear layers against the machine's arithmetic peak (not a test).

    python benchmarks/bench_linear.py [--rows 1,8,32,512,2048] [--threads 1,2]

Prints two tables:

1. Peak FLOP/s of this CPU, measured: independent chains of float32 fused multiply-adds
   (512-bit where our kernels run AVX-512, else 256-bit: a cap of ``RADIXSERVE_CPU_ISA`` applies)
   and of bf16 pair dot products (``vdpbf16ps``,
   AVX512-BF16 only) on every thread (``benchmarks/peak_flops.cpp``).
2. SmolLM2's four projections (fused qkv, o, gate_up, down) over 30 layers — a model's worth
   of weights, so decode rows stream them from memory as the model does — per row count and
   thread count, in GFLOP/s and the share of the measured float32 peak, for every linear
   backend of ``radixserve.kernels.linear`` that runs here: ``F.linear`` (float32 and bf16),
   oneDNN-packed weights (hint 32, as the model packs), and the kernels' packed GEMM on float32
   and on bf16 weights (float32 compute), and its bf16 dot products (csrc/gemm_dot.cpp:
   native vdpbf16ps where the CPU has it, else their emulation). Contenders run interleaved, best of ``--reps``.
   The max abs diff of each packed path against float32 ``F.linear`` on the same rows is printed.
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

from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.library import try_load_kernels  # noqa: E402
from radixserve.kernels.linear import PACK_ROWS_HINT, onednn_linear, onednn_supported  # noqa: E402

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


def measured_peaks(threads: int, width: int) -> dict[str, float]:
    """{"float32": FLOP/s, "bfloat16": FLOP/s} of ``width``-bit vectors (512 or 256) from
    benchmarks/peak_flops.cpp (0 if unsupported)."""
    from radixserve.kernels import builder

    try:
        lib_path = builder.build("radixserve_peak", [Path(__file__).with_name("peak_flops.cpp")])
    except builder.KernelBuildError as e:
        print(f"(peak probe unavailable: {e})")
        return {"float32": 0.0, "bfloat16": 0.0}
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.radixserve_peak_flops
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return {name: max(fn(bf16, 20_000_000, threads, width) for _ in range(3))
            for name, bf16 in (("float32", 0), ("bfloat16", 1))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512,2048")
    ap.add_argument("--threads", default=str(torch.get_num_threads()))
    ap.add_argument("--layers", type=int, default=30, help="copies of each weight (a model's worth)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time each run by the calling thread's CPU time (use with --threads 1 on a busy machine)")
    args = ap.parse_args(argv)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    threads = [int(t) for t in args.threads.split(",")]
    kern = try_load_kernels()
    if kern is not None:
        kern = kern.capped()  # $RADIXSERVE_CPU_ISA, as the model applies it
    # the peak of the vectors our kernels use at this cap (F.linear / oneDNN ignore the cap)
    width = 512 if kern is not None and kern.isa == "avx512" else 256
    print(f"CPU: {describe()}; torch {torch.__version__}; our kernels at {kern.isa if kern else 'none'}; "
          f"one pass over {args.layers} layers x {len(SHAPES)} projections, best of {args.reps}, "
          f"contenders interleaved\n")
    peaks = {t: measured_peaks(t, width) for t in threads}
    print(f"| threads | float32 FMA peak GFLOP/s ({width}-bit) | bf16 dot-product peak GFLOP/s |")
    print("|---:|---:|---:|")
    for t, p in peaks.items():
        print(f"| {t} | {p['float32'] / 1e9:.0f} | {p['bfloat16'] / 1e9:.0f} |")
    print()
    gen = torch.Generator().manual_seed(0)
    dense32 = [torch.randn(s, generator=gen).mul_(0.05) for _ in range(args.layers) for s in SHAPES]
    cpu = torch.device("cpu")
    # name -> (weights, linear(x32, w) -> out, x dtype)
    contenders: dict[str, tuple[list, object, torch.dtype]] = {
        "F.linear f32": (dense32, F.linear, torch.float32)}
    dense16 = [w.to(torch.bfloat16) for w in dense32]
    contenders["F.linear bf16"] = (dense16, F.linear, torch.bfloat16)
    for dt, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        if onednn_supported(cpu, dt):
            src = dense32 if dt == torch.float32 else dense16
            contenders[f"oneDNN {tag}"] = ([torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in src],
                                           onednn_linear, dt)
    if kern is not None:
        for dt, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16 weights")):
            contenders[f"radixserve {tag}"] = ([kern.pack_linear(w, dt) for w in dense32],
                                               kern.packed_linear, torch.float32)
        contenders["radixserve bf16 dot"] = ([kern.pack_linear(w, torch.bfloat16, dot=True) for w in dense32],
                                             kern.packed_linear, torch.float32)
    names = list(contenders)
    print("| threads | rows | " + " | ".join(f"{n} GFLOP/s" for n in names) + " | ours / peak |")
    print("|---:|---:|" + "---:|" * (len(names) + 1))
    before = torch.get_num_threads()
    for t in threads:
        torch.set_num_threads(t)
        for rows in map(int, args.rows.split(",")):
            flops = 2 * rows * sum(o * i for o, i in SHAPES) * args.layers
            xs = {k: torch.randn(rows, k, generator=gen) for k in {s[1] for s in SHAPES}}
            best = {n: float("inf") for n in names}
            runs = {}
            for n, (ws, fn, xdt) in contenders.items():
                xn = {k: v.to(xdt) for k, v in xs.items()}
                runs[n] = (lambda ws=ws, fn=fn, xn=xn: [fn(xn[dense32[i].shape[1]], w) for i, w in enumerate(ws)])
                runs[n]()
            for _ in range(args.reps):
                for n in names:
                    t0 = clock()
                    runs[n]()
                    best[n] = min(best[n], clock() - t0)
            peak = peaks[t]["float32"]
            ours = [b for n, b in best.items() if n.startswith("radixserve")]
            top = flops / min(ours or best.values())
            # the peak probe runs on the wall clock: no share against it for CPU-time figures
            share = f"{top / peak * 100:.0f}%" if peak and not args.cpu_time else "–"
            print(f"| {t} | {rows} | " + " | ".join(f"{flops / best[n] / 1e9:.0f}" for n in names) + f" | {share} |")
    torch.set_num_threads(before)
    # accuracy of each path on one layer's projections, against float32 F.linear
    x = {k: torch.randn(7, k, generator=gen) for k in {s[1] for s in SHAPES}}
    diffs = []
    for n, (ws, fn, xdt) in contenders.items():
        d = max((fn(x[dense32[i].shape[1]].to(xdt), ws[i]).float() - F.linear(x[dense32[i].shape[1]], dense32[i]))
                .abs().max().item() for i in range(len(SHAPES)))
        diffs.append(f"{n} {d:.1e}")
    print("\nmax abs diff vs float32 F.linear (7 rows, one layer): " + ", ".join(diffs))


if __name__ == "__main__":
    main()
