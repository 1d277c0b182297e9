"""Collect run_bench.sh results into one markdown table.

    python benchmarks/peers/summarize.py /opt/peers/results [TAG ...]
"""
from __future__ import annotations

import json
import os
import re
import sys

WORKLOADS = ("few-shot", "multi-turn-short", "tree-of-thought", "gsp")


def loads(root: str, tag: str) -> dict[str, str]:
    """1-minute load average logged before each workload's run."""
    out: dict[str, str] = {}
    try:
        for line in open(os.path.join(root, tag, "log.txt")):
            m = re.match(r"== \S+ (\S+) .*load average: ([\d.]+)", line)
            if m:
                out[m.group(1)] = m.group(2)
    except OSError:
        pass
    return out


def main(root: str, tags: list[str]) -> None:
    tags = tags or sorted(os.listdir(root))
    print("| engine | workload | rate | reqs (err) | prompt tok | out tok | hit rate | optimum "
          "| req/s | out tok/s | in+out tok/s | TTFT p50 ms | TTFT p90 ms | E2E p50 ms | wall s | load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tag in tags:
        la = loads(root, tag)
        for w in WORKLOADS:
            p = os.path.join(root, tag, w, "results.json")
            if not os.path.exists(p):
                continue
            s = json.load(open(p))["summaries"][0]
            rate = s["request_rate"] if s["request_rate"] is not None else float("inf")
            print(f"| {tag} | {w} | {rate:g} | {s['requests']} ({s['errors']}) | {s['prompt_tokens']} "
                  f"| {s['completion_tokens']} | {100 * s['hit_rate']:.1f}% "
                  f"| {100 * s['optimal_hit_rate']:.1f}% | {s['requests_per_s']:.2f} "
                  f"| {s['output_tokens_per_s']:.1f} | {s['total_tokens_per_s']:.0f} "
                  f"| {1000 * s['ttft_p50']:.0f} | {1000 * s['ttft_p90']:.0f} "
                  f"| {1000 * s['latency_p50']:.0f} | {s['wall_seconds']:.2f} | {la.get(w, '?')} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
