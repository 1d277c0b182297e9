"""The fused row-wise kernels against ``torch.compile`` of the same eager ops (not a test).

    python benchmarks/bench_rowops_compile.py [--threads 1]

The decoder layer's ops between the matmuls — residual add + RMSNorm, RoPE, SiLU·mul — three
ways on SmolLM2's shapes: the hand-written kernels of ``kernels/csrc`` (what the "torch"
backend runs), ``torch.compile(dynamic=True)`` (inductor, the way vLLM compiles the dense
parts of its CPU models) of the eager functions, and the eager functions themselves. Prints
the compile times (first call, and the call that makes the token count dynamic; ``--cold``
compiles into a fresh inductor cache, as a first start on a new machine would) and the
per-call CPU time at 1, 32, 512 and 2048 tokens (best of 30; process CPU time, so other
jobs on a shared machine distort it less than wall time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.kernels.library import load_kernels  # noqa: E402
from radixserve.model.arch.layers import apply_rotary, rms_norm  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
EPS = 1e-5


def add_norm(hidden: torch.Tensor, delta: torch.Tensor, w: torch.Tensor):
    hidden = hidden + delta.float()
    return hidden, rms_norm(hidden, w, EPS).to(torch.bfloat16)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    t = qkv.shape[0]
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].float().view(t, HEADS + KV_HEADS, HEAD_DIM)
    return apply_rotary(qk, cos[pos], sin[pos]).to(torch.bfloat16)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return (F.silu(gu[:, :INTER].float()) * gu[:, INTER:].float()).to(torch.bfloat16)


def _best(fn, reps: int = 30) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="compile into a fresh inductor cache")
    args = ap.parse_args(argv)
    if args.cold:
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    torch.set_num_threads(args.threads)
    k = load_kernels()
    compiled = {f.__name__: torch.compile(f, dynamic=True) for f in (add_norm, rope, silu_mul)}
    w = torch.rand(HIDDEN) + 0.5
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.arange(4096).float()[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    print(f"torch {torch.__version__}, {args.threads} thread(s); per-call CPU time in µs "
          "(compiled / kernel / eager)\n")
    print("| tokens | compile s | add + RMSNorm | RoPE | SiLU·mul |")
    print("|---:|---:|---:|---:|---:|")
    for t in (1, 32, 512, 2048):
        hidden, delta = torch.randn(t, HIDDEN), torch.randn(t, HIDDEN).bfloat16()
        qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
        pos = torch.arange(t)
        gu = torch.randn(t, 2 * INTER).bfloat16()
        t0 = time.perf_counter()
        compiled["add_norm"](hidden, delta, w)
        compiled["rope"](qkv, cos, sin, pos)
        compiled["silu_mul"](gu)
        compile_s = time.perf_counter() - t0
        cells = []
        for name, kern, eager in (
            ("add_norm", lambda: k.add_rms_norm(hidden, delta, w, EPS, torch.bfloat16),
             lambda: add_norm(hidden, delta, w)),
            ("rope", lambda: k.rope_(qkv, pos, cos, sin, HEADS + KV_HEADS, HEAD_DIM),
             lambda: rope(qkv, cos, sin, pos)),
            ("silu_mul", lambda: k.silu_mul(gu), lambda: silu_mul(gu)),
        ):
            c = compiled[name]
            args_ = {"add_norm": (hidden, delta, w), "rope": (qkv, cos, sin, pos), "silu_mul": (gu,)}[name]
            cells.append(f"{_best(lambda: c(*args_)) * 1e6:.0f} / {_best(kern) * 1e6:.0f} / "
                         f"{_best(eager) * 1e6:.0f}")
        print(f"| {t} | {compile_s:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
