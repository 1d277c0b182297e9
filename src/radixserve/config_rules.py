"""The rules of every option: the names a field may take, the defaults two configs share,
and the validators the config dataclasses (:mod:`radixserve.config`, the router's
:mod:`radixserve.placement.config`, HiCache's view) run on construction, each raising
``ValueError`` naming the field."""

from __future__ import annotations

import importlib.metadata
import math
import os
from typing import Any
from urllib.parse import urlparse


DEFAULT_MODEL = "smollm2-135m"
CACHE_KINDS = ("radix", "table", "none")
POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
DEFAULT_POLICY = "lpm"  # the scheduler's order of waiting requests
DTYPES = ("float32", "bfloat16", "auto")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
ATTENTION_BACKENDS = ("torch", "torch-eager")
CPU_ISAS = ("auto", "generic", "avx2", "avx512", "amx")  # instruction-set levels, lowest first, after "auto"
#: The environment variable that caps a whole process's instruction set (radixserve.kernels.isa).
ISA_ENV = "RADIXSERVE_CPU_ISA"


def check_isa_name(value: str, where: str) -> str:
    """``value`` lower-cased if it names a level (or ``auto``), else ValueError naming ``where``."""
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in CPU_ISAS:
        raise ValueError(f"{where} must be one of {CPU_ISAS}, got {value!r}")
    return v
LINEAR_BACKENDS = ("auto", "radixserve", "radixserve-f32", "onednn", "torch")
#: How the linear weights are held: a GGUF's blocks as shipped (expanded to the dense bfloat16
#: model's weights, computed with integer dot products, or on their codes with the scale per
#: block), per-channel int8, or dense.
WEIGHT_DTYPES = ("auto", "gguf", "gguf-q8", "gguf-codes", "int8", "dense")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
ROUTER_POLICIES = ("cache_aware", "round_robin", "shortest_queue", "prefix_hash", "random")
DEFAULT_ROUTER_POLICY = "cache_aware"  # the router's and the dp client's
#: Speculative decoding: off, or drafts from the radix tree (radixserve.sched.speculation).
SPECULATIVE_KINDS = ("none", "ngram-tree")
SPECULATIVE_PRICINGS = ("measured", "row-cost")
#: Torch threads a step runs on: the configured count always, or fewer while other processes
#: use the cores (radixserve.engine.threads).
THREAD_POLICIES = ("adaptive", "fixed")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Where a command listens (``serve`` and ``router``), and how much it logs.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
DEFAULT_LOG_LEVEL = "info"


def package_version() -> str:
    """The installed package's version: pyproject.toml is its only declaration."""
    try:
        return importlib.metadata.version("radixserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


#: Fields whose value must come from a fixed set, with the set (used by validation and CLI).
CHOICES: dict[str, tuple[str, ...]] = {
    "cache": CACHE_KINDS,
    "policy": POLICIES,
    "dtype": DTYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "cpu_isa": CPU_ISAS,
    "linear_backend": LINEAR_BACKENDS,
    "weight_dtype": WEIGHT_DTYPES,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_prefetch_policy": HICACHE_PREFETCH_POLICIES,
    "dp_policy": ROUTER_POLICIES,
    "speculative": SPECULATIVE_KINDS,
    "speculative_pricing": SPECULATIVE_PRICINGS,
    "thread_policy": THREAD_POLICIES,
    "log_level": LOG_LEVELS,
}


def check_choice(obj: Any, name: str, choices: tuple[str, ...] | None = None) -> None:
    v, choices = getattr(obj, name), choices or CHOICES[name]
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")


def check_int(obj: Any, name: str, lo: int, hi: int | None = None) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {bound}, got {v!r}")


def check_api_keys(obj: Any) -> None:
    """Validate (and normalise to a tuple) ``api_key``, ``api_key_file`` and ``admin_key`` of
    a frozen config: the server's and the router's (which must map keys to tenants as the
    servers behind it do) take the same fields."""
    keys = obj.api_key
    if not isinstance(keys, (str, tuple, list)):
        raise ValueError(f"api_key must be a list of keys, got {keys!r}")
    object.__setattr__(obj, "api_key", (keys,) if isinstance(keys, str) else tuple(keys))
    for k in obj.api_key:
        if not isinstance(k, str) or not k.strip():
            raise ValueError("api_key must not be empty (an empty key would disable authentication)")
    if not isinstance(obj.api_key_file, str):
        raise ValueError(f"api_key_file must be a path, got {obj.api_key_file!r}")
    if obj.api_key_file and not os.path.isfile(obj.api_key_file):
        raise ValueError(f"api_key_file {obj.api_key_file!r} does not exist")
    if not isinstance(obj.admin_key, str):
        raise ValueError(f"admin_key must be a string, got {obj.admin_key!r}")


def check_float(obj: Any, name: str, lo: float, hi: float) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")


def check_positive(obj: Any, name: str) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{name} must be a number > 0, got {v!r}")


def check_storage_url(url: str, field: str = "storage") -> str:
    """Validate a HiCache storage URL without opening it (ValueError naming ``field``)."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"{field} must be file:///path or redis://host:port/db, got {url!r}")
    u = urlparse(url)
    if u.scheme not in ("file", "redis", "rediss", "unix"):
        raise ValueError(f"{field} must be file:///path or redis://host:port/db, got scheme {u.scheme!r}")
    if u.scheme == "file" and (u.netloc not in ("", "localhost") or not u.path):
        raise ValueError(f"{field} must be file:///absolute/path, got {url!r}")
    if u.scheme in ("redis", "rediss") and not u.hostname:
        raise ValueError(f"{field} must name a host (redis://host:port/db), got {url!r}")
    return url


def check_hicache(obj: Any, prefix: str) -> None:
    """The HiCache fields of ``obj``, named ``prefix + name``: ``EngineConfig`` checks its
    ``hicache_*`` fields and ``HiCacheConfig`` (``prefix=""``) the same ones, with this code."""
    p = prefix
    check_int(obj, p + "l2_tokens", 0)
    check_int(obj, p + "ghost_entries", 0)
    for name in ("write_through_threshold", "prefetch_min_tokens", "storage_page_tokens", "write_queue_pages"):
        check_int(obj, p + name, 1)
    check_choice(obj, p + "write_policy", HICACHE_WRITE_POLICIES)
    check_choice(obj, p + "prefetch_policy", HICACHE_PREFETCH_POLICIES)
    check_float(obj, p + "prefetch_timeout_s", 0.0, 3600.0)
    check_float(obj, p + "storage_timeout_s", 1e-3, 1e6)
    check_float(obj, p + "storage_retry_s", 0.0, 1e6)
    if getattr(obj, p + "storage") not in (None, ""):
        check_storage_url(getattr(obj, p + "storage"), p + "storage")
        if not getattr(obj, p + "l2_tokens"):
            raise ValueError(f"{p}storage needs {p}l2_tokens > 0 (L2 stages every L3 transfer)")


def check_bools(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(obj, name)!r}")
