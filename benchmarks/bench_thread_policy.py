"""``--thread-policy adaptive`` against fixed thread counts, with and without a neighbour
process that keeps one core busy (not a test: prints wall-clock seconds).

    python benchmarks/bench_thread_policy.py [--model gemma3-270m] [--requests 16] [--rounds 2]

Each configuration runs in a fresh interpreter (one process per engine, as a server's engine
core is): ShareGPT first turns, ``--requests`` of them eight at a time, 32 greedy tokens each,
after a warm-up. Per round the configurations run in turn, once on their own and once while a
neighbour process spins on one core (``while True: pass``), so that a noisy machine hits every
configuration alike; the table prints each run's wall seconds and the thread count the
adaptive policy ended on. The answer is the same bits in every row (``tests/test_threads.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(_HERE, "..", "src")

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from radixserve import SamplingParams
from radixserve.bench.workloads import sharegpt
from radixserve.engine.engine import Engine
model, threads, policy, n = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
eng = Engine(model, num_threads=threads, thread_policy=policy)
prompts = [r.prompt for r in next(iter(sharegpt(eng.tokenizer, num_requests=n)))]
sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
eng.generate(prompts[:2], sp)
t0 = time.perf_counter()
for i in range(0, n, 8):
    eng.generate(prompts[i:i + 8], sp)
s = eng.core.stats()
print(json.dumps({"wall": time.perf_counter() - t0, "threads": s["threads"], "changes": s["thread_changes"]}))
"""


def run(model: str, threads: int, policy: str, requests: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, _SRC, model, str(threads), policy, str(requests)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    configs = [(cores, "fixed"), (cores, "adaptive"), (1, "fixed")]
    sys.path.insert(0, _SRC)
    from radixserve.bench.cli import _machine

    print(f"`python benchmarks/bench_thread_policy.py {' '.join(sys.argv[1:])}` — "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')} — {_machine()} — {args.model}, {args.requests} requests\n")
    print("| round | neighbour | threads, policy | wall s | adaptive ended on |")
    print("|---:|---|---|---:|---:|")
    for rnd in range(args.rounds):
        for neighbour in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
            try:
                for threads, policy in configs:
                    r = run(args.model, threads, policy, args.requests)
                    ended = f"{r['threads']} ({r['changes']} changes)" if policy == "adaptive" else "–"
                    print(f"| {rnd + 1} | {'one core busy' if neighbour else 'none'} | {threads}, {policy} | "
                          f"{r['wall']:.2f} | {ended} |", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()


if __name__ == "__main__":
    main()
