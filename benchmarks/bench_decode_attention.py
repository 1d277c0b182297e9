"""The paged attention kernel alone on decode-shaped calls: KV heads run together with the
next key block loaded ahead (the default) against every item alone with no loads ahead
(``RADIXSERVE_ATTENTION_GROUPS=0``), in one process, alternating call by call so a noisy
neighbour hits both alike. Not a test; prints a table.

    python benchmarks/bench_decode_attention.py
    python benchmarks/bench_decode_attention.py --threads 2

Each case is one step's attention over ``--layers`` layers of a bfloat16 pool (bf16 dot
products where the CPU has AVX512-BF16) four times the size of the step's K/V, far larger than
the caches. ``--layout runs``: each sequence's slots one run at a random place in the pool (a
prompt prefilled in one go); ``scattered``: every slot at random (a pool fragmented by
eviction); ``both`` (the default) prints both. The two ways must give the same bits; the
script checks.
Time: the thread's CPU time with one thread, wall clock with more.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.kernels.isa import host_isa  # noqa: E402
from radixserve.kernels.library import load_kernels  # noqa: E402

SWITCH = "RADIXSERVE_ATTENTION_GROUPS"
#: (name, sequences, context, query rows per sequence, q heads, KV heads, head dim, shared
#: prefix: the first tokens of every sequence's context in the same slots, as sequences that
#: extend one cached prefix)
CASES = [
    ("SmolLM2 decode B=1", 1, 512, 1, 9, 3, 64, 0),
    ("SmolLM2 decode B=1, 2048 ctx", 1, 2048, 1, 9, 3, 64, 0),
    ("SmolLM2 decode B=8", 8, 512, 1, 9, 3, 64, 0),
    ("SmolLM2 verify B=8 (1 + 3 drafts)", 8, 512, 4, 9, 3, 64, 0),
    ("SmolLM2 prefill 64 after 448", 1, 512, 64, 9, 3, 64, 0),
    ("SmolLM2 decode B=8, 448 of 512 shared", 8, 512, 1, 9, 3, 64, 448),
    ("SmolLM2 decode B=8, 1984 of 2048 shared", 8, 2048, 1, 9, 3, 64, 1984),
    ("Gemma 3 270M decode B=8, 448 of 512 shared", 8, 512, 1, 4, 1, 256, 448),
    ("Gemma 3 270M decode B=8", 8, 512, 1, 4, 1, 256, 0),
    ("Llama 1B shape decode B=8", 8, 512, 1, 32, 8, 64, 0),
    ("one KV head of 64, decode B=24", 24, 512, 1, 3, 1, 64, 0),
]


def cpu_line() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, kernels' ISA level {host_isa()}"


def place(b: int, ctx: int, shared: int, pool: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """Slots of b sequences of ctx tokens whose first ``shared`` are the same slots."""
    own = ctx - shared
    if layout == "scattered":
        perm = torch.randperm(pool, generator=gen)
        prefix, rest = perm[:shared], perm[shared : shared + b * own]
        return torch.cat([torch.cat([prefix, rest[i * own : (i + 1) * own]]) for i in range(b)])
    starts = torch.randperm(pool // ctx, generator=gen)[: b + 1] * ctx
    prefix = torch.arange(starts[b], starts[b] + shared)
    return torch.cat([torch.cat([prefix, torch.arange(s, s + own)]) for s in starts[:b].tolist()])


def run_case(ops, case, layers: int, reps: int, threads: int, layout: str):
    name, b, ctx, qlen, h, kv, d, shared = case
    gen = torch.Generator().manual_seed(0)
    pool = 4 * (b + 1) * ctx + 64
    kc = [torch.randn(pool, kv, d, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    vc = [torch.randn(pool, kv, d, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    q = torch.randn(b * qlen, h, d, generator=gen).to(torch.bfloat16)
    slots = place(b, ctx, shared, pool, layout, gen).to(torch.long)
    info = torch.tensor([[i * qlen, qlen, i * ctx, ctx] for i in range(b)], dtype=torch.long)
    outs = {w: torch.empty(b * qlen, h * d, dtype=torch.bfloat16) for w in ("grouped", "alone")}
    clock = time.thread_time if threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"grouped": [], "alone": []}

    def step(way: str) -> float:
        if way == "alone":
            os.environ[SWITCH] = "0"
        else:
            os.environ.pop(SWITCH, None)
        t0 = clock()
        for layer in range(layers):
            ops.paged_attention(q, kc[layer], vc[layer], slots, info, outs[way], d ** -0.5, 0)
        return clock() - t0

    for r in range(reps + 2):
        for way in ("grouped", "alone") if r % 2 else ("alone", "grouped"):
            t = step(way)
            if r >= 2:
                times[way].append(t)
    os.environ.pop(SWITCH, None)
    if not torch.equal(outs["grouped"], outs["alone"]):
        raise SystemExit(f"{name}: the two ways gave different bits")
    med = {w: sorted(v)[len(v) // 2] * 1e3 for w, v in times.items()}
    return name, med["alone"], med["grouped"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layout", default="both", choices=["runs", "scattered", "both"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_kernels()
    ops = torch.ops.radixserve
    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {args.threads} thread(s); "
          f"{'thread CPU time' if args.threads == 1 else 'wall clock'}, median of {args.reps} alternated pairs")
    print()
    print("| case | slots | alone, no loads ahead (ms) | grouped, loads ahead (ms) | ratio |")
    print("|---|---|---:|---:|---:|")
    layouts = ["runs", "scattered"] if args.layout == "both" else [args.layout]
    for case in CASES:
        for layout in layouts:
            name, alone, grouped = run_case(ops, case, args.layers, args.reps, args.threads, layout)
            print(f"| {name} | {layout} | {alone:.2f} | {grouped:.2f} | {alone / grouped:.2f}x |", flush=True)
    print()
    print("Same bits both ways in every case (checked).")


if __name__ == "__main__":
    main()
