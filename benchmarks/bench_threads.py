"""Thread placement: decode speed per torch thread count and OpenMP wait policy, alone and
next to a process that keeps one core busy.

Each configuration runs in a fresh interpreter (OpenMP reads its environment once, at load):
SmolLM2 decodes ``--tokens`` tokens of one greedy request, three times; the median ms/token
is printed. The "busy neighbour" column repeats every configuration while another process
spins on one core: what an engine sees on a shared host, or next to its own API process
when that is busy.

OpenMP's default (threads spin a while at every barrier before sleeping) is fastest when
the cores are the engine's; with a neighbour, a spinning thread waits for one that is not
running, and every parallel region (several per layer) pays for it.

    python benchmarks/bench_threads.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time
from radixserve import Engine, SamplingParams
eng = Engine("smollm2-135m", num_threads=int(sys.argv[1]))
n = int(sys.argv[2])
sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
eng.generate(["hi"], SamplingParams(max_tokens=4))
r = []
for _ in range(3):
    t0 = time.perf_counter(); eng.generate(["The story begins"], sp); r.append((time.perf_counter() - t0) / n * 1e3)
print(sorted(r)[1])
"""

CONFIGS = [  # label, threads, extra environment
    ("2 threads, OpenMP default (spin)", 2, {}),
    ("2 threads, GOMP_SPINCOUNT=10000", 2, {"GOMP_SPINCOUNT": "10000"}),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("1 thread", 1, {}),
]


def measure(threads: int, env: dict[str, str], tokens: int) -> float:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(tokens)], env={**e, **env},
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; medians reported")
    args = ap.parse_args()
    print("$ python benchmarks/bench_threads.py " + " ".join(sys.argv[1:]), flush=True)
    res: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for label, threads, env in CONFIGS:
                    res.setdefault((label, busy), []).append(measure(threads, env, args.tokens))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print("\n| decode, batch 1 (ms/token) | cores to itself | one core busy with a neighbour |")
    print("|---|---:|---:|")
    for label, _, _ in CONFIGS:
        print(f"| {label} | {statistics.median(res[(label, False)]):.1f} | "
              f"{statistics.median(res[(label, True)]):.1f} |")


if __name__ == "__main__":
    main()
