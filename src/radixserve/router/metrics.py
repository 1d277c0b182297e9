"""``/metrics`` of the router: the workers' series summed, plus the router's own.

Counters and histograms add up across workers. Gauges add up too (requests running,
tokens cached, capacity) except ratios, which are recomputed from the sums
(``prefix_cache_hit_rate``) or averaged (``kv_cache_usage``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Dict, Iterable, List, Tuple

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from radixserve.router.fleet import Router

__all__ = ["sum_metrics", "render_metrics"]

_AVERAGED = ("kv_cache_usage",)
_PREFIX = "radixserve"


def _fmt_labels(labels: Iterable[Tuple[str, str]]) -> str:
    items = [f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels]
    return "{" + ",".join(items) + "}" if items else ""


def _fmt_value(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(float(v))


def sum_metrics(texts: List[str]) -> "OrderedDict[str, dict]":
    """Families by name: ``{"type", "help", "samples": {(sample name, labels): value}}``."""
    fams: "OrderedDict[str, dict]" = OrderedDict()
    counts: Dict[Tuple[str, str, tuple], int] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            f = fams.setdefault(fam.name, {"type": fam.type, "help": fam.documentation, "samples": OrderedDict()})
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                f["samples"][key] = f["samples"].get(key, 0.0) + s.value
                counts[(fam.name, *key)] = counts.get((fam.name, *key), 0) + 1
    for name, f in fams.items():
        if name.endswith(_AVERAGED):
            for key in f["samples"]:
                f["samples"][key] /= counts[(name, *key)]
    q = fams.get(f"{_PREFIX}_prefix_cache_query_tokens")
    h = fams.get(f"{_PREFIX}_prefix_cache_hit_tokens")
    rate = fams.get(f"{_PREFIX}_prefix_cache_hit_rate")
    if q and h and rate:
        qs, hs = sum(q["samples"].values()), sum(h["samples"].values())
        for key in rate["samples"]:
            rate["samples"][key] = hs / qs if qs else 0.0
    return fams


def render_metrics(router: "Router", worker_texts: List[str]) -> str:
    lines: List[str] = []
    for name, f in sum_metrics(worker_texts).items():
        lines.extend([f"# HELP {name} {f['help']} (sum over workers)", f"# TYPE {name} {f['type']}"])
        for (sname, labels), v in f["samples"].items():
            lines.append(f"{sname}{_fmt_labels(labels)} {_fmt_value(v)}")

    def family(name: str, kind: str, doc: str, samples: List[Tuple[dict, float]]) -> None:
        full = f"{_PREFIX}_router_{name}"
        lines.extend([f"# HELP {full} {doc}", f"# TYPE {full} {kind}"])
        sname = full + ("_total" if kind == "counter" else "")
        for labels, v in samples:
            lines.append(f"{sname}{_fmt_labels(sorted(labels.items()))} {_fmt_value(v)}")

    family("requests", "counter", "generation requests received", [({}, router.requests)])
    family("retries", "counter", "requests sent again to another worker", [({}, router.retries)])
    family("failed_requests", "counter", "requests no worker could answer", [({}, router.failed_requests)])
    family("stream_errors", "counter", "streams ended by a worker failure", [({}, router.stream_errors)])
    family("route_seconds", "counter", "time spent choosing workers", [({}, router.route_seconds)])
    ws = router.workers
    family("worker_available", "gauge", "1 if the worker takes requests",
           [({"worker": w.url}, float(w.available())) for w in ws])
    family("worker_outstanding_requests", "gauge", "requests in flight to the worker",
           [({"worker": w.url}, w.outstanding) for w in ws])
    family("worker_routed_requests", "counter", "requests routed to the worker",
           [({"worker": w.url}, w.routed) for w in ws])
    family("worker_predicted_hit_tokens", "counter", "prompt tokens the router predicted the worker would find cached",
           [({"worker": w.url}, w.predicted_hit_tokens) for w in ws])
    family("worker_failures", "counter", "transport failures of requests to the worker",
           [({"worker": w.url}, w.failures) for w in ws])
    mirrored = [w for w in ws if w.mirror is not None]
    family("mirror_synced", "gauge", "1 if the worker's cache mirror is in sync",
           [({"worker": w.url}, float(w.mirror.synced)) for w in mirrored])  # type: ignore[union-attr]
    family("mirror_tokens", "gauge", "tokens the mirror says the worker holds",
           [({"worker": w.url, "tier": tier}, t.num_tokens)
            for w in mirrored for tier, t in w.mirror.trees.items()])  # type: ignore[union-attr]
    family("mirror_resyncs", "counter", "snapshots applied after the first",
           [({"worker": w.url}, w.mirror.status.resyncs) for w in mirrored])  # type: ignore[union-attr]
    return "\n".join(lines) + "\n"
