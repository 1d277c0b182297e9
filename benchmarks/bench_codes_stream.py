"""How fast a one-row (decode) linear on block codes reads its weight, resident in the last-level
cache and streamed from memory, beside the dense bfloat16 kernel and a plain sum (not a test).

    python benchmarks/bench_codes_stream.py [--format Q4_0] [--k 2048] [--rounds 4]

One thread, timed by its CPU time. Two weights of K columns: a small one (``--small-n`` rows,
a few MiB: after the first call it stays in L3) and a large one (``--large-n`` rows, larger
than L3: every call streams it from memory). For each: GB/s of the blocks as stored (the
file's bytes) for ``gguf-codes`` and of the bfloat16 panels for the dense kernel, and the read
bandwidth of a sum over 1 GiB in the same round. The blocks' codes and scales are random.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))

from radixserve.kernels import library as kernels  # noqa: E402
from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.quant_weights import QuantTensor, pack_quant_tensor  # noqa: E402

_BLOCK = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q8_0": (32, 34, (0,))}


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Raw GGUF blocks [n, bytes per row]: random codes, fp16 scales (and offsets) ~ N(0, 0.05)."""
    bk, bb, f16_at = _BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n, k // bk, bb), dtype=np.uint8)
    for at in f16_at:
        d = (rng.standard_normal((n, k // bk)) * 0.05).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // bk, 2)
    return raw.reshape(n, -1)


def gbps(fn, nbytes: int, reps: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.thread_time() - t0) / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="Q4_0", choices=sorted(_BLOCK))
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--small-n", type=int, default=3072)
    ap.add_argument("--large-n", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    k = kernels.load_kernels()
    rng = np.random.default_rng(0)
    big = torch.ones(2**28)
    print(f"CPU: {describe()}; torch {torch.__version__}, 1 thread, thread CPU time; {args.format}, K={args.k}")
    cases = {}
    for label, n in (("in L3", args.small_n), ("from memory", args.large_n)):
        raw = random_blocks(rng, args.format, n, args.k)
        qt = QuantTensor.from_gguf(args.format, raw, (n, args.k))
        codes = pack_quant_tensor(k, qt.for_block_codes(), dot=True)
        dense = k.pack_linear(qt.dequantize().to(torch.bfloat16), torch.bfloat16, dot=True)
        x, out = torch.randn(1, args.k), torch.empty(1, n)
        reps = max(2, int(4e8 // dense.data.nbytes))
        cases[label] = (raw.nbytes, dense.data.nbytes, reps,
                        lambda w=codes, x=x, o=out: k.packed_linear(x, w, out=o),
                        lambda w=dense, x=x, o=out: k.packed_linear(x, w, out=o))
    rows: dict[str, list[tuple[float, float]]] = {label: [] for label in cases}
    sums = []
    for _ in range(args.rounds):
        sums.append(gbps(lambda: big.sum(), big.nbytes, 2))
        for label, (cb, db, reps, fc, fd) in cases.items():
            rows[label].append((gbps(fc, cb, reps * 4), gbps(fd, db, reps)))
    print(f"sum over 1 GiB: {statistics.median(sums):.1f} GB/s (rounds: {', '.join(f'{s:.1f}' for s in sums)})")
    print("| weight | blocks MiB | codes GB/s (rounds) | dense bf16 MiB | dense GB/s (rounds) |")
    print("|---|---:|---:|---:|---:|")
    for label, (cb, db, _, _, _) in cases.items():
        c = [r[0] for r in rows[label]]
        d = [r[1] for r in rows[label]]
        print(f"| {label} | {cb / 2**20:.0f} | {statistics.median(c):.1f} ({', '.join(f'{v:.1f}' for v in c)}) "
              f"| {db / 2**20:.0f} | {statistics.median(d):.1f} ({', '.join(f'{v:.1f}' for v in d)}) |")


if __name__ == "__main__":
    main()
