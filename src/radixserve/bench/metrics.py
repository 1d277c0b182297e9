"""Per-request records, run results and the numbers a report shows.

Definitions (as in the paper's evaluation):

* hit rate = prompt tokens served from the cache / prompt tokens;
* offline-optimal hit rate = 1 - distinct-tree tokens / prompt tokens, where distinct-tree
  tokens is the number of nodes of a token trie over all prompts of the run (each distinct
  prefix computed exactly once, with an unbounded cache); reported with the ratio
  hit rate / optimum. For workloads with dependent rounds the engine also caches decoded
  tokens, which later prompts reuse, so the ratio can exceed 1 there;
* throughput = requests (and input/output tokens) per wall-clock second;
* TTFT = first token time - arrival; end-to-end latency = finish - arrival;
* tree share = seconds spent in prefix-cache operations / wall seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestRecord", "RunResult", "trie_nodes", "offline_optimal_hit_rate",
           "percentile", "summarize"]


@dataclass
class RequestRecord:
    id: str
    round: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    arrival: float  # seconds since the run started
    first_token: float | None
    finish: float
    text: str = ""
    prompt_token_ids: list[int] | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float:
        return self.finish - self.arrival


@dataclass
class RunResult:
    workload: str
    config: dict[str, Any]  # engine, cache, policy, kv_cache_tokens, mode, ...
    records: list[RequestRecord]
    wall_seconds: float
    engine_stats: dict[str, Any] = field(default_factory=dict)  # deltas over the run
    tag: str = "main"  # "main" or "sweep" (cache-size sweep)

    @property
    def label(self) -> str:
        c = self.config
        if c.get("engine", "radixserve") != "radixserve":
            return str(c["engine"])
        if c.get("mode") == "online":
            return f"online:{c.get('served_model', '?')}"
        return f"{c.get('cache')}/{c.get('policy')}"


def trie_nodes(seqs: Sequence[Sequence[int]]) -> int:
    """Nodes of a token trie over ``seqs`` (= distinct non-empty prefixes). Sorted
    lexicographically, each sequence adds its length minus its longest common prefix with its
    predecessor (the predecessor shares the longest prefix of all earlier ones)."""
    ordered = sorted(tuple(s) for s in seqs)
    total = 0
    prev: tuple[int, ...] = ()
    for s in ordered:
        n = min(len(s), len(prev))
        lcp = 0
        while lcp < n and s[lcp] == prev[lcp]:
            lcp += 1
        total += len(s) - lcp
        prev = s
    return total


def offline_optimal_hit_rate(seqs: Sequence[Sequence[int]]) -> float:
    total = sum(len(s) for s in seqs)
    return 1.0 - trie_nodes(seqs) / total if total else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN if empty."""
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(run: RunResult) -> dict[str, Any]:
    recs = [r for r in run.records if r.error is None]
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    out_tok = sum(r.completion_tokens for r in recs)
    wall = max(run.wall_seconds, 1e-9)
    seqs = [r.prompt_token_ids for r in recs if r.prompt_token_ids is not None]
    optimum = offline_optimal_hit_rate(seqs) if seqs and len(seqs) == len(recs) else math.nan
    hit = cached / prompt if prompt else 0.0
    ttfts = [t for t in (r.ttft for r in recs) if t is not None]
    lats = [r.latency for r in recs]
    tree = run.engine_stats.get("tree_seconds")
    s: dict[str, Any] = {
        "workload": run.workload,
        "label": run.label,
        "tag": run.tag,
        **run.config,
        "requests": len(recs),
        "errors": len(run.records) - len(recs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "completion_tokens": out_tok,
        "hit_rate": hit,
        "optimal_hit_rate": optimum,
        "hit_ratio_of_optimum": (hit / optimum) if optimum and optimum > 0 else math.nan,
        "ideal_speedup": (prompt / (prompt - cached)) if prompt > cached else math.inf,
        "wall_seconds": run.wall_seconds,
        "requests_per_s": len(recs) / wall,
        "input_tokens_per_s": prompt / wall,
        "output_tokens_per_s": out_tok / wall,
        "total_tokens_per_s": (prompt + out_tok) / wall,
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        **{f"ttft_p{q}": percentile(ttfts, q) for q in (50, 90, 99)},
        "latency_mean": sum(lats) / len(lats) if lats else math.nan,
        **{f"latency_p{q}": percentile(lats, q) for q in (50, 90, 99)},
        "tree_seconds": tree if tree is not None else math.nan,
        "tree_share": (tree / wall) if tree is not None else math.nan,
    }
    keys = ("forward_seconds", "computed_prefill_tokens", "evicted_tokens", "retractions")
    return s | {k: run.engine_stats[k] for k in keys if k in run.engine_stats}
