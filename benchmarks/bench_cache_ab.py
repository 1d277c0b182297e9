"""The radix tree of an older revision against this checkout's, in one process on one trace,
rounds interleaved (not a test: prints numbers). For refactors of the tree: a ratio measured
side by side holds on a shared machine where two separate runs do not.

The older revision's plain cache (the top-level modules of its ``cache/`` package, which
import only each other) is extracted with ``git show`` into a temporary package.
Prints, per page size and key form, the median and range of old/new CPU time per operation
(> 1: this checkout is faster).

    python benchmarks/bench_cache_ab.py --base 88fc0ff
    taskset -c 0 python benchmarks/bench_cache_ab.py --base 88fc0ff --seqs 5000 --rounds 11
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.join(_HERE, "..")
sys.path.insert(0, os.path.join(_ROOT, "src"))


def _old_cache(rev: str, into: str):
    pkg = os.path.join(into, "oldcache")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    names = subprocess.run(["git", "-C", _ROOT, "ls-tree", "--name-only", f"{rev}:src/radixserve/cache/"],
                           check=True, capture_output=True, text=True).stdout.split()
    for f in (n[:-3] for n in names if n.endswith(".py") and n != "__init__.py"):
        text = subprocess.run(["git", "-C", _ROOT, "show", f"{rev}:src/radixserve/cache/{f}.py"],
                              check=True, capture_output=True, text=True).stdout
        with open(os.path.join(pkg, f + ".py"), "w") as fh:
            fh.write(text)
    sys.path.insert(0, into)
    from oldcache.radix import RadixCache

    return RadixCache


def trace(n: int, seed: int = 0):
    rng = random.Random(seed)
    pre = [[rng.randrange(1, 50000) for _ in range(200)] for _ in range(100)]
    seqs = [pre[i % 100] + [rng.randrange(1, 50000) for _ in range(300)] for i in range(n)]
    part = [pre[i % 100] + [rng.randrange(1, 50000) for _ in range(300)] for i in range(n)]
    return seqs, part


def one(cls, ps, seqs, part, packed):
    S = [array("I", s) for s in seqs] if packed else seqs
    P = [array("I", s) for s in part] if packed else part
    slots = [torch.arange(i * 500, (i + 1) * 500) for i in range(len(seqs))]
    gc.collect()
    gc.disable()
    c = cls(page_size=ps)
    t = time.process_time()
    for s, v in zip(S, slots):
        c.insert(s, v)
    ti = time.process_time() - t
    t = time.process_time()
    for s in S:
        c.match_prefix(s)
    tf = time.process_time() - t
    t = time.process_time()
    for s in P:
        c.match_prefix(s)
    tp = time.process_time() - t
    t = time.process_time()
    c.evict(c.total_size)
    te = time.process_time() - t
    gc.enable()
    return {"insert": ti, "full": tf, "partial": tp, "evict": te}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the older revision (git rev)")
    ap.add_argument("--seqs", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    from radixserve.bench.cli import _machine
    from radixserve.cache.radix import RadixCache as New

    with tempfile.TemporaryDirectory() as tmp:
        Old = _old_cache(args.base, tmp)
        seqs, part = trace(args.seqs)
        print(f"`python benchmarks/bench_cache_ab.py {' '.join(sys.argv[1:])}` — {_machine()} — "
              f"{args.seqs} sequences x 500 tokens, {args.rounds} interleaved rounds; old/new CPU time, "
              f"median [min-max] (> 1: this checkout is faster)")
        for ps in (1, 16):
            for packed in (False, True):
                ratios: dict = {k: [] for k in ("insert", "full", "partial", "evict")}
                for r in range(args.rounds):
                    order = (Old, New) if r % 2 == 0 else (New, Old)
                    res = {cls: one(cls, ps, seqs, part, packed) for cls in order}
                    for k in ratios:
                        ratios[k].append(res[Old][k] / res[New][k])
                print(f"page {ps:2d} {'packed' if packed else 'lists '}: " + "  ".join(
                    f"{k} {statistics.median(v):.3f}x [{min(v):.2f}-{max(v):.2f}]" for k, v in ratios.items()),
                    flush=True)


if __name__ == "__main__":
    main()
