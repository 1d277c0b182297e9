"""Markdown tables and the JSON file of a benchmark run."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["markdown_table", "write_json", "fmt"]


_KINDS = {"pct": lambda v: f"{100 * v:.1f}%", "pct2": lambda v: f"{100 * v:.2f}%",
          "ms": lambda v: f"{1000 * v:.0f}", "x": lambda v: f"{v:.2f}×"}


def fmt(v: Any, kind: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    if kind in _KINDS:
        return _KINDS[kind](v)
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


COLUMNS: list[tuple[str, str, str]] = [
    ("workload", "workload", ""),
    ("label", "config", ""),
    ("requests", "reqs", ""),
    ("prompt_tokens", "prompt tok", ""),
    ("hit_rate", "hit rate", "pct"),
    ("optimal_hit_rate", "optimum", "pct"),
    ("hit_ratio_of_optimum", "hit/opt", "pct"),
    ("requests_per_s", "req/s", ""),
    ("total_tokens_per_s", "tok/s", ""),
    ("ttft_p50", "TTFT p50 ms", "ms"),
    ("ttft_p90", "p90", "ms"),
    ("ttft_p99", "p99", "ms"),
    ("latency_p50", "E2E p50 ms", "ms"),
    ("tree_share", "tree time", "pct2"),
    ("wall_seconds", "wall s", ""),
]


def markdown_table(rows: Sequence[dict[str, Any]],
                   columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    head = "| " + " | ".join(c[1] for c in columns) + " |"
    sep = "|" + "|".join("---" if not c[2] and c[0] in ("workload", "label") else "---:"
                         for c in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), kind) for k, _, kind in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(payload), f, indent=2)
