"""How fast a decode step's two big reads run, per instruction-set level (not a test).

    python benchmarks/bench_decode_reads.py [--rows 1,2,4] [--ctx 512] [--reps 7]

1. The packed GEMM over a model's worth of SmolLM2-135M weights (30 layers x fused qkv, o,
   gate_up, down, plus the 49,152-row lm_head; bf16 weights, float32 compute) at a decode
   step's few rows, packed as the model packs them (one buffer on 2 MB pages): ms per pass
   and GB/s of weights read, for each level the CPU has
   (``generic`` is left out: it is the reference, not a contender).
2. The paged attention of one decode step (9 query heads over 3 KV heads of 64, a bfloat16
   pool) at batch 1 over ``--ctx`` keys, for 30 layers' pools, slots shuffled (scattered
   pages) and in one ascending run: µs per layer and GB/s of K/V read.
3. A decode batch of 8 sequences that share their first ``--ctx`` keys' slots (a cached
   prefix) plus 32 keys of their own, and the same batch sharing nothing: µs per layer.

Levels run interleaved and the median of ``--reps`` passes is printed, with the read
bandwidth the same-sized buffer gets (``bench_model.mem_bandwidth``) measured right after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_model import mem_bandwidth  # noqa: E402
from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.library import IMPL_AVX2, IMPL_BF16, IMPL_F32, IMPL_NAMES, try_load_kernels  # noqa: E402
from radixserve.kernels.linear import Linears  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def gemm_table(k, rows: list[int], reps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    # As the model packs them (Linears.pack_many): one buffer on 2 MB pages, the lm_head its own.
    layers = Linears("radixserve", torch.bfloat16, k)
    ws = layers.pack_many([torch.randn(n, kk, generator=gen) * 0.02 for n, kk in SHAPES[:-1]])
    ws += layers.pack_many([torch.randn(*SHAPES[-1], generator=gen) * 0.02])
    nbytes = sum(n * kk * 2 for n, kk in SHAPES)
    levels = [i for i in k.available_isas() if i != "generic"]
    views = {lv: k.capped(lv) for lv in levels}
    print(f"\n| rows | {' | '.join(f'{lv} ms | {lv} GB/s' for lv in levels)} |")
    print("|---:|" + "---:|---:|" * len(levels))
    for m in rows:
        xs = {kk: torch.randn(m, kk, generator=gen) for kk in (576, 1536)}
        times: dict[str, list[float]] = {lv: [] for lv in levels}
        for _ in range(reps + 1):
            for lv, kv in views.items():
                t0 = time.perf_counter()
                for (_, kk), w in zip(SHAPES, ws):
                    kv.packed_linear(xs[kk], w)
                times[lv].append(time.perf_counter() - t0)
        cells = []
        for lv in levels:
            t = _median(times[lv][1:])
            cells += [f"{t * 1e3:.2f}", f"{nbytes / t / 1e9:.1f}"]
        print(f"| {m} | {' | '.join(cells)} |")
    print(f"\n{nbytes / 1e6:.0f} MB of weights a pass; a {nbytes / 1e6:.0f} MB read gets "
          f"{mem_bandwidth(nbytes=nbytes) / 1e9:.1f} GB/s here")


def _attention_seconds(k, impls: list[int], pools, q, slots, seq, out, reps: int) -> dict[int, float]:
    """Median seconds per layer of one decode step's attention over every layer's pool, per
    implementation (implementations interleaved; the first pass is a warm-up)."""
    D = q.shape[-1]
    times: dict[int, list[float]] = {i: [] for i in impls}
    for _ in range(reps + 1):
        for i in impls:
            t0 = time.perf_counter()
            for kc, vc in pools:
                k.attention(q, kc, vc, slots, seq, out, D ** -0.5, impl=i)
            times[i].append((time.perf_counter() - t0) / len(pools))
    return {i: _median(times[i][1:]) for i in impls}


def attention_table(k, ctx: int, reps: int) -> None:
    layers, H, KV, D, nslots = 30, 9, 3, 64, 200_000
    gen = torch.Generator().manual_seed(1)
    pools = [(torch.randn(nslots, KV, D, generator=gen).to(torch.bfloat16),
              torch.randn(nslots, KV, D, generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    q = torch.randn(1, H, D, generator=gen)
    out = torch.empty(1, H * D)
    seq = torch.tensor([[0, 1, 0, ctx]], dtype=torch.int64)
    impls = [i for i in (IMPL_AVX2, IMPL_F32, IMPL_BF16) if k.impl_available(i, torch.bfloat16, D)]
    kv_bytes = 2 * ctx * KV * D * 2
    print(f"\n| slots | {' | '.join(f'{IMPL_NAMES[i]} µs/layer' for i in impls)} | K/V per layer |")
    print("|---|" + "---:|" * (len(impls) + 1))
    for name, slots in (("shuffled", torch.randperm(nslots, generator=gen)[:ctx]),
                        ("one run", torch.arange(ctx) + 1000)):
        t = _attention_seconds(k, impls, pools, q, slots, seq, out, reps)
        cells = [f"{t[i] * 1e6:.1f} ({kv_bytes / t[i] / 1e9:.1f} GB/s)" for i in impls]
        print(f"| {name} | {' | '.join(cells)} | {kv_bytes / 1e3:.0f} KB |")


def shared_table(k, ctx: int, reps: int, nseq: int = 8, own: int = 32) -> None:
    """A decode batch of ``nseq`` sequences whose first ``ctx`` keys are the same slots (one
    cached prefix) plus ``own`` keys each, against the same batch with no slot in common."""
    layers, H, KV, D = 30, 9, 3, 64
    nslots = nseq * (ctx + own) + 1000
    gen = torch.Generator().manual_seed(2)
    pools = [(torch.randn(nslots, KV, D, generator=gen).to(torch.bfloat16),
              torch.randn(nslots, KV, D, generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    q = torch.randn(nseq, H, D, generator=gen)
    out = torch.empty(nseq, H * D)
    impls = [i for i in (IMPL_AVX2, IMPL_F32, IMPL_BF16) if k.impl_available(i, torch.bfloat16, D)]
    print(f"\n| {nseq} sequences, {ctx} + {own} keys | {' | '.join(f'{IMPL_NAMES[i]} µs/layer' for i in impls)} |")
    print("|---|" + "---:|" * len(impls))
    for name, shared in (("prefix slots shared", True), ("no slot shared", False)):
        seqs, rows, start = [], [], 0
        for s in range(nseq):
            base = 0 if shared else s * (ctx + own)
            tail = nseq * ctx + s * own if shared else base + ctx
            sl = torch.cat([torch.arange(base, base + ctx), torch.arange(tail, tail + own)])
            seqs.append(sl)
            rows.append([s, 1, start, len(sl)])
            start += len(sl)
        slots, seq = torch.cat(seqs), torch.tensor(rows, dtype=torch.int64)
        t = _attention_seconds(k, impls, pools, q, slots, seq, out, reps)
        print(f"| {name} | {' | '.join(f'{t[i] * 1e6:.1f}' for i in impls)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    k = try_load_kernels()
    if k is None:
        sys.exit("the C++ kernels are not available here")
    print(f"CPU: {describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    gemm_table(k, [int(r) for r in args.rows.split(",")], args.reps)
    attention_table(k, args.ctx, args.reps)
    shared_table(k, args.ctx, args.reps)


if __name__ == "__main__":
    main()
