"""PNG plots of a benchmark run (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["write_plots", "plot_tiers"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_hit_rate_vs_cache(summaries: Sequence[dict[str, Any]], path: str) -> bool:
    pts: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in summaries:
        if s.get("engine") == "radixserve" and s.get("kv_cache_tokens") and s.get("cache") == "radix":
            pts[f"{s['workload']} ({s.get('policy')})"].append((s["kv_cache_tokens"], s["hit_rate"]))
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, xy in sorted(pts.items()):
        xy = sorted(set(xy))
        ax.plot([x for x, _ in xy], [100 * y for _, y in xy], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="KV cache size (tokens)", ylabel="prefix cache hit rate (%)", ylim=(0, 100),
           title="Hit rate vs cache size (radix)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_throughput(summaries: Sequence[dict[str, Any]], path: str) -> bool:
    main = [s for s in summaries if s.get("tag") == "main"]
    if not main:
        return False
    workloads = list(dict.fromkeys(s["workload"] for s in main))
    labels = list(dict.fromkeys(s["label"] for s in main))
    val = {(s["workload"], s["label"]): s["requests_per_s"] for s in main}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(workloads) * max(1, len(labels)) / 2), 4))
    w = 0.8 / max(1, len(labels))
    for j, lab in enumerate(labels):
        xs = [i + j * w for i in range(len(workloads))]
        ys = [val.get((wl, lab), 0.0) for wl in workloads]
        ax.bar(xs, ys, width=w, label=lab)
    ax.set_xticks([i + w * (len(labels) - 1) / 2 for i in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=20, fontsize=8)
    ax.set(ylabel="requests / s", title="Throughput by configuration")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, path)


def plot_ttft(runs: Sequence[Any], path: str) -> bool:
    series = []
    for run in runs:
        if run.tag != "main":
            continue
        t = sorted(r.ttft for r in run.records if r.ttft is not None and r.error is None)
        if t:
            series.append((f"{run.workload} {run.label}", t))
    if not series:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, t in series:
        ys = [(i + 1) / len(t) for i in range(len(t))]
        ax.step([1000 * x for x in t], ys, where="post", label=name)
    lo = min(t[0] for _, t in series)
    if lo > 0 and max(t[-1] for _, t in series) / lo > 20:
        ax.set_xscale("log")
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT distribution (CDF)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def write_plots(runs: Sequence[Any], summaries: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fn, arg in (
        ("hit_rate_vs_cache_size.png", plot_hit_rate_vs_cache, summaries),
        ("throughput.png", plot_throughput, summaries),
        ("ttft.png", plot_ttft, runs),
    ):
        p = os.path.join(out_dir, name)
        if fn(arg, p):
            written.append(p)
    return written


def plot_tiers(results: Sequence[Any], path: str) -> bool:
    """``radixserve bench --hicache``: hit rate and requests/s per configuration, and mean
    TTFT after a cold vs a warm restart (one row of panels per workload)."""
    results = [r for r in results if r.rows]
    if not results:
        return False
    plt = _plt()
    fig, axes = plt.subplots(len(results), 3, figsize=(13, 3.8 * len(results)), squeeze=False)
    for (ax_hit, ax_rps, ax_ttft), res in zip(axes, results):
        names = [r["config"] for r in res.rows]
        xs = range(len(names))
        ax_hit.bar(xs, [100 * r["hit_rate"] for r in res.rows], color="tab:blue")
        ref = res.rows[0]["hit_rate"]
        ax_hit.axhline(100 * 0.95 * ref, color="tab:red", ls="--", lw=1, label="95% of unbounded L1")
        ax_hit.set(ylabel="prefix cache hit rate (%)", ylim=(0, 100))
        ax_hit.legend(fontsize=7, loc="lower right")
        ax_rps.bar(xs, [r["requests_per_s"] for r in res.rows], color="tab:green")
        ax_rps.set_ylabel("requests / s")
        for ax in (ax_hit, ax_rps):
            ax.set_xticks(list(xs))
            ax.set_xticklabels(names, rotation=20, fontsize=7)
            ax.grid(axis="y", alpha=0.3)
        ax_hit.set_title(f"{res.rows[0]['workload']}: working set {res.working_set} tok, "
                         f"L1 {res.l1}, L2 {res.l2}", fontsize=8)
        if res.restarts:
            labels = ["cold"] + [f"warm\n{r['config'].removeprefix('L1+L2+')}" for r in res.restarts]
            vals = [1000 * res.restarts[0]["ttft_cold"]] + [1000 * r["ttft_warm"] for r in res.restarts]
            ax_ttft.bar(range(len(vals)), vals, color=["tab:gray"] + ["tab:orange"] * len(res.restarts))
            ax_ttft.axhline(0.3 * vals[0], color="tab:red", ls="--", lw=1, label="0.3x cold")
            ax_ttft.set(xticks=range(len(vals)), ylabel="mean TTFT after restart (ms)")
            ax_ttft.set_xticklabels(labels, fontsize=7)
            ax_ttft.legend(fontsize=7)
            ax_ttft.grid(axis="y", alpha=0.3)
        else:
            ax_ttft.set_axis_off()
    return _save(plt, fig, path)
