"""Prometheus metrics of one server instance.

Each app gets its own ``CollectorRegistry`` (never the global one), so several servers in one
process — the test suite starts many — do not collide or double count.

Two sources feed it:
- per-request counters and latency histograms, observed when a request ends (finished,
  aborted or failed);
- engine-wide numbers (prefix-cache query/hit tokens, running/waiting requests, KV usage)
  read from the engine core's ``stats()`` at scrape time, so they are exact and cost
  nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.request import RequestOutput

PREFIX = "radixserve"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)
_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5,
)


class _EngineStatsCollector(Collector):
    """Exposes the last ``Engine.stats()`` snapshot (set just before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics(self.snapshot)) if self.snapshot else []

    @staticmethod
    def _metrics(s: dict[str, Any]) -> Iterator[Metric]:
        def one(name: str, doc: str, key: str, kind: str = "counter") -> Metric:
            m = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"{PREFIX}_{name}", doc)
            m.add_metric([], float(s.get(key, 0)))
            return m

        yield one("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache",
                  "prefix_cache_query_tokens")
        yield one("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", "prefix_cache_hit_tokens")
        yield one("computed_prefill_tokens", "prompt tokens actually computed", "computed_prefill_tokens")
        yield one("evicted_tokens", "tokens evicted from the prefix cache", "evicted_tokens")
        yield one("retractions", "requests retracted to free KV memory", "retractions")
        yield one("num_running_requests", "requests prefilling or decoding", "running_requests", "gauge")
        yield one("num_waiting_requests", "requests waiting for admission", "waiting_requests", "gauge")
        yield one("kv_cache_usage", "share of KV slots not free (0..1)", "kv_usage", "gauge")
        yield one("kv_capacity_tokens", "KV pool capacity in tokens", "kv_capacity_tokens", "gauge")
        yield one("cached_tokens", "tokens held by the prefix cache tree", "cached_tokens", "gauge")
        yield one("evictable_tokens", "cached tokens no running request holds", "evictable_tokens", "gauge")
        yield one("prefix_cache_hit_rate", "hit tokens / query tokens since start", "prefix_cache_hit_rate",
                  "gauge")
        # Images (a vision-language model) and Mamba state snapshots (a hybrid state-space
        # model): only when the core reports them.
        for name, doc, key, kind in _IMAGE_STATS + _MAMBA_STATS:
            if key in s:
                yield one(name, doc, key, kind)
        yield one("speculative_draft_tokens", "speculative decoding: draft tokens verified", "speculative_draft_tokens")
        yield one("speculative_accepted_tokens", "speculative decoding: draft tokens accepted",
                  "speculative_accepted_tokens")
        yield one("speculative_verified_rows", "speculative decoding: decode rows that verified a "
                  "draft (each gives its accepted tokens plus one)", "speculative_verified_rows")
        rows = float(s.get("speculative_verified_rows", 0))
        m = GaugeMetricFamily(f"{PREFIX}_speculative_tokens_per_verified_row",
                              "speculative decoding: tokens a decode row with a draft gave, on average")
        m.add_metric([], (rows + float(s.get("speculative_accepted_tokens", 0))) / rows if rows else 0.0)
        yield m
        yield one("failed_requests", "requests that ended with an error", "failed_requests")
        yield one("failed_steps", "engine steps whose forward pass raised", "failed_steps")
        if "hicache" in s:
            yield from _hicache_metrics(s["hicache"])


_IMAGE_STATS = (
    ("prefix_cache_image_query_tokens", "image positions of prompts looked up in the prefix cache",
     "image_query_tokens", "counter"),
    ("prefix_cache_image_hit_tokens", "image positions served from the prefix cache",
     "cached_image_tokens", "counter"),
    ("images_encoded", "images run through the vision encoder", "images_encoded", "counter"),
    ("image_encoder_seconds", "time spent in the vision encoder", "image_encoder_seconds", "counter"),
    ("image_embedding_cache_hits", "images whose encoder output came from the embedding cache",
     "image_cache_hits", "counter"),
    ("image_embedding_cache_misses", "images the embedding cache did not hold", "image_cache_misses",
     "counter"),
    ("image_embedding_cache_bytes", "bytes of encoder outputs held", "image_cache_bytes", "gauge"),
)


_MAMBA_STATS = (
    ("mamba_snapshot_hits", "admissions that resumed from a Mamba state snapshot", "mamba_snapshot_hits",
     "counter"),
    ("mamba_snapshot_tokens_saved", "prompt tokens not recomputed because a Mamba state snapshot held them",
     "mamba_snapshot_tokens_saved", "counter"),
    ("mamba_snapshots_evicted", "Mamba state snapshots evicted (their nodes and KV stay)", "mamba_snapshots_evicted",
     "counter"),
    ("mamba_snapshots", "Mamba state snapshots the prefix cache holds", "mamba_snapshots", "gauge"),
    ("mamba_snapshot_bytes", "bytes of Mamba state the snapshots hold", "mamba_snapshot_bytes", "gauge"),
    ("mamba_interval_snapshots_taken", "Mamba state snapshots taken at a multiple of --mamba-snapshot-interval",
     "mamba_interval_snapshots_taken", "counter"),
)


def _labelled(kind: type, name: str, doc: str, label: str, values: dict[str, Any]) -> Metric:
    m = kind(f"{PREFIX}_{name}", doc, labels=[label])
    for k, v in values.items():
        m.add_metric([str(k)], float(v or 0))
    return m


def _histogram(name: str, doc: str, label: str, per_label: dict[str, dict]) -> Metric:
    m = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=[label] if label else None)
    for lv, h in per_label.items():
        buckets = [("+Inf" if b == float("inf") else repr(float(b)), float(c)) for b, c in h["buckets"]]
        m.add_metric([lv] if label else [], buckets, float(h["sum"]))
    return m


def _hicache_metrics(h: dict[str, Any]) -> Iterator[Metric]:
    """HiCache: where hits came from, why misses missed, what moved between tiers, and the
    age of content at hit and at eviction per tier (the pair that tells an operator whether
    a tier is too small for the traffic's reuse window)."""
    yield _labelled(CounterMetricFamily, "cache_hit_tokens_by_tier",
                    "prompt tokens served from the cache, by the tier they came from", "tier", h["hit_tokens"])
    yield _labelled(CounterMetricFamily, "cache_miss_tokens_by_reason",
                    "prompt tokens that had to be computed, by why they were not cached", "reason", h["miss_tokens"])
    yield _labelled(CounterMetricFamily, "cache_bytes_moved", "KV bytes copied between tiers",
                    "path", h["bytes_moved"])
    yield _labelled(GaugeMetricFamily, "cache_tier_tokens", "tokens held per tier", "tier",
                    {"L1": h["l1"]["tokens"], "L2": h["l2"]["tokens"]})
    pf = h["prefetch"]
    yield _labelled(CounterMetricFamily, "cache_prefetch", "L3 prefetches by outcome", "outcome",
                    {k: v for k, v in pf.items() if isinstance(v, (int, float))})
    yield _histogram("cache_prefetch_latency_seconds", "L3 prefetch latency", "", {"": pf["latency_s"]})
    st = h.get("storage") or {}
    yield _labelled(CounterMetricFamily, "cache_storage_events", "storage operations and failures",
                    "event", {k: v for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    yield _histogram("cache_age_at_hit_seconds", "age of cached content when it was hit", "tier", h["age_at_hit_s"])
    yield _histogram("cache_age_at_eviction_seconds", "age of content when it left a tier", "tier",
                     h["age_at_eviction_s"])


class ServerMetrics:
    """Per-request counters carry a ``tenant`` label ("-" without authentication), so each
    tenant's share is visible and the shares add up to the totals; the engine-wide numbers
    (cache hits over all tenants) are only served to the admin (see ``auth.ADMIN_PATHS``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)

        def per_tenant(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, ["tenant"], registry=r)

        self.prompt_tokens = per_tenant("prompt_tokens", "prompt tokens of finished requests")
        self.cached_prompt_tokens = per_tenant("cached_prompt_tokens",
                                               "prompt tokens of finished requests served from the prefix cache")
        self.generation_tokens = per_tenant("generation_tokens", "generated tokens of finished requests")
        self.draft_tokens = per_tenant("draft_tokens", "speculative decoding: draft tokens verified for finished "
                                       "requests")
        self.accepted_prediction_tokens = per_tenant("accepted_prediction_tokens", "speculative decoding: draft "
                                                     "tokens accepted for finished requests")
        self.requests = Counter(f"{PREFIX}_requests", "finished requests by finish reason", ["tenant", "finish_reason"],
                                registry=r)
        self.image_requests = per_tenant("image_requests", "requests queued with at least one image")
        self.images = per_tenant("images", "images received in requests")
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "mean time between generated tokens of a request (after the first)",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "submission to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._engine = _EngineStatsCollector()
        r.register(self._engine)

    def observe_finished(self, out: RequestOutput, submitted: float, tenant: str | None = None) -> None:
        """Record one ended request (called once per request)."""
        t = tenant or "-"
        self.prompt_tokens.labels(tenant=t).inc(out.prompt_tokens)
        self.cached_prompt_tokens.labels(tenant=t).inc(out.cached_tokens)
        self.generation_tokens.labels(tenant=t).inc(len(out.token_ids))
        self.draft_tokens.labels(tenant=t).inc(out.draft_tokens)
        self.accepted_prediction_tokens.labels(tenant=t).inc(out.accepted_draft_tokens)
        self.requests.labels(tenant=t, finish_reason=out.finish_reason or "unknown").inc()
        if out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            n = len(out.token_ids)
            if out.finish_time is not None and n > 1:
                self.tpot.observe(max(0.0, (out.finish_time - out.first_token_time) / (n - 1)))
        if out.finish_time is not None:
            self.e2e.observe(max(0.0, out.finish_time - submitted))

    def observe_images(self, per_request: Sequence[Sequence[Any]], tenant: str | None = None) -> None:
        """Record the images of queued requests (one entry per request, possibly empty)."""
        t = tenant or "-"
        for ims in per_request:
            if ims:
                self.image_requests.labels(tenant=t).inc()
                self.images.labels(tenant=t).inc(len(ims))

    def render(self, engine_stats: dict[str, Any]) -> bytes:
        """Prometheus text exposition, with the engine numbers of ``engine_stats``."""
        self._engine.snapshot = dict(engine_stats)
        return generate_latest(self.registry)
