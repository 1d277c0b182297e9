"""Every option of radixserve, declared once: two frozen dataclasses validated on construction.

* :class:`EngineConfig` — what the engine core needs (model, cache, scheduling, memory).
  ``Engine(config)`` takes it; the engine-core process is started from it.
* :class:`ServerConfig` — what the API process needs (address, keys, limits, logging).

Each field is also a CLI flag (:mod:`radixserve.flags` derives ``--flag`` names, types, choices
and help from the dataclass, ``config_help.FIELD_HELP`` and ``config_rules.CHOICES``), so a new
option is one field here (and its help text) and nothing else. Validation raises
``ValueError`` naming the field, before any model is loaded; the rules live in
:mod:`radixserve.config_rules`, and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from radixserve.config_help import FIELD_HELP
from radixserve.config_rules import (  # noqa: F401 (re-exported: one place to import options from)
    ATTENTION_BACKENDS, CACHE_KINDS, CHOICES, CPU_ISAS, DEFAULT_HOST, DEFAULT_LOG_LEVEL, DEFAULT_MODEL, DEFAULT_POLICY, DEFAULT_PORT,
    DEFAULT_ROUTER_POLICY, DTYPES, HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES, ISA_ENV,
    KV_CACHE_DTYPES, LINEAR_BACKENDS, LOG_LEVELS, POLICIES, ROUTER_POLICIES, SPECULATIVE_KINDS,
    THREAD_POLICIES, WEIGHT_DTYPES, check_api_keys, check_bools, check_choice, check_float,
    check_hicache, check_int, check_isa_name, check_storage_url, package_version,
)


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    cache: str = "radix"
    policy: str = DEFAULT_POLICY
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "torch"
    cpu_isa: str = "auto"
    linear_backend: str = "auto"
    weight_dtype: str = "auto"
    page_size: int = 1
    kv_cache_tokens: int = 65536
    #: How the KV pool stores K/V: "auto" = the weights' dtype; int8 / fp8_e4m3 keep one float32
    #: scale per token and KV head beside the codes.
    kv_cache_dtype: str = "auto"
    #: Hybrid (sliding-window) models: SWA slots beside the full ones; 0 = auto (every running
    #: request's window, at least a quarter of kv_cache_tokens, at most all of them).
    swa_kv_cache_tokens: int = 0
    #: Hybrid models: a KV pool per kind (False: every layer in one pool, as for full attention).
    hybrid_kv: bool = True
    #: Hybrid Mamba models: Mamba state snapshots the prefix cache may keep (each a copy of every
    #: Mamba layer's conv + SSM state after some prefix); 0 = auto (max_running_requests).
    mamba_snapshots: int = 0
    #: Hybrid Mamba models: also snapshot the state every this many tokens of a prefill (at
    #: absolute positions that are multiples of it); 0 = off (request ends and branch points only).
    mamba_snapshot_interval: int = 0
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 2048
    max_context_len: int = 0
    mixed_steps: bool = True
    lpm_fallback_queue_len: int = 512
    lpm_max_wait_s: float = 30.0
    lpm_max_passes: int = 64
    decode_reserve_ratio: float = 0.3
    decode_reserve_clip: int = 1024
    in_batch_sharing: bool = True
    in_batch_sharing_min_tokens: int = 4
    session_ttl_s: float = 300.0
    max_sessions: int = 1024
    seed: int = 0
    #: Structured outputs: tokens a grammar forces are appended as one extend step.
    grammar_fast_forward: bool = True
    #: Speculative decoding: "ngram-tree" drafts each decoding request's next tokens from the
    #: radix tree (and its own output) and verifies them in the decode step; "none" is off.
    speculative: str = "none"
    num_draft_tokens: int = 4
    speculative_min_ngram: int = 2
    speculative_max_ngram: int = 6
    #: A decode row's cost relative to a decode step's fixed cost (sched/step_costs.py): the
    #: price of a draft token's row ("row-cost"), or the prior until steps of that many rows
    #: are measured ("measured").
    speculative_row_cost: float = 0.25
    speculative_pricing: str = "row-cost"
    #: Images (vision-language models): key image tokens by content (shared across requests),
    #: and keep this many bytes of vision-encoder outputs by content hash (0 = off).
    image_content_keys: bool = True
    image_cache_bytes: int = 256 * 2**20
    num_threads: int = 0
    thread_policy: str = "adaptive"
    kv_events_endpoint: str = ""
    hicache_l2_tokens: int = 0
    hicache_storage: str = ""
    hicache_write_policy: str = "write_through"
    hicache_write_through_threshold: int = 2
    hicache_prefetch_policy: str = "timeout"
    hicache_prefetch_timeout_s: float = 1.0
    hicache_storage_page_tokens: int = 64
    hicache_prefetch_min_tokens: int = 1
    hicache_write_queue_pages: int = 256
    hicache_storage_timeout_s: float = 1.0
    hicache_storage_retry_s: float = 5.0
    hicache_ghost_entries: int = 32768
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""
    dist_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model must be a non-empty string (a name or a path)")
        for name in ("cache", "policy", "dtype", "kv_cache_dtype", "attention_backend", "cpu_isa", "linear_backend",
                     "weight_dtype", "thread_policy"):
            check_choice(self, name)
        for name in ("page_size", "kv_cache_tokens", "max_running_requests", "max_prefill_tokens",
                     "chunked_prefill_size", "lpm_fallback_queue_len", "lpm_max_passes",
                     "in_batch_sharing_min_tokens", "max_sessions"):
            check_int(self, name, 1)
        if self.cpu_isa == "auto":
            # a bad $RADIXSERVE_CPU_ISA is an error now, not at model load
            check_isa_name(os.environ.get(ISA_ENV, "") or "auto", ISA_ENV)
        for name in ("num_threads", "swa_kv_cache_tokens", "mamba_snapshots", "mamba_snapshot_interval",
                     "max_context_len", "decode_reserve_clip", "image_cache_bytes"):
            check_int(self, name, 0)
        check_int(self, "seed", 0, 2**63 - 1)
        check_float(self, "decode_reserve_ratio", 0.0, 1.0)
        check_float(self, "lpm_max_wait_s", 0.0, 1e9)
        check_float(self, "session_ttl_s", 0.0, 1e6)
        check_bools(self, ("mixed_steps", "in_batch_sharing", "hybrid_kv", "grammar_fast_forward",
                           "image_content_keys"))
        if self.kv_cache_tokens < 4 * self.page_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least 4 pages of {self.page_size}"
            )
        if not isinstance(self.kv_events_endpoint, str):
            raise ValueError(f"kv_events_endpoint must be a string, got {self.kv_events_endpoint!r}")
        check_hicache(self, "hicache_")
        if self.hicache_storage_page_tokens % self.page_size:
            raise ValueError(f"hicache_storage_page_tokens ({self.hicache_storage_page_tokens}) must be "
                             f"a multiple of page_size ({self.page_size})")
        if self.hicache_l2_tokens and self.cache != "radix":
            raise ValueError("hicache_l2_tokens needs cache='radix' (the tiers live in the radix tree)")
        self._check_parallel()
        self._check_speculative()

    def _check_speculative(self) -> None:
        check_choice(self, "speculative")
        check_int(self, "num_draft_tokens", 1, 64)
        check_int(self, "speculative_min_ngram", 1, 64)
        check_int(self, "speculative_max_ngram", self.speculative_min_ngram, 64)
        check_float(self, "speculative_row_cost", 0.0, 100.0)
        check_choice(self, "speculative_pricing")
        if self.speculative == "none":
            return
        # The validated configurations: the plain, hybrid or tiered (HiCache) radix tree, on one
        # rank or two tensor-parallel ranks (a sum of two partials is the same in either order;
        # over more ranks the order gloo adds them in is its algorithm's, not shown to be the
        # same whatever the step's row count).
        if self.cache != "radix":
            raise ValueError(f"speculative={self.speculative!r} drafts from the radix tree: it needs "
                             f"cache='radix', got {self.cache!r}")
        if self.tp_size > 2:
            raise ValueError(f"speculative={self.speculative!r} is validated with tp_size up to 2, got "
                             f"{self.tp_size} (the order the ranks' partial sums meet in is not shown to be "
                             f"the same at every row count); use --tp 2, or several speculating engine "
                             f"cores with --dp")

    def _check_parallel(self) -> None:
        check_int(self, "tp_size", 1, 1024)
        check_int(self, "nnodes", 1, 1024)
        check_int(self, "node_rank", 0, self.nnodes - 1)
        check_float(self, "dist_timeout_s", 1.0, 1e6)
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): "
                             "every node runs the same number of ranks")
        addr = self.dist_init_addr
        if not isinstance(addr, str):
            raise ValueError(f"dist_init_addr must be a string HOST:PORT, got {addr!r}")
        if addr:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
        if self.nnodes > 1 and not addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT where rank 0 listens)")
        if self.tp_size > 1 and self.hicache_l2_tokens:
            raise ValueError("hicache_l2_tokens is not supported with tp_size > 1 yet "
                             "(the tiers copy rank 0's KV pool only)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: tuple[str, ...] = ()
    api_key_file: str = ""
    admin_key: str = ""
    served_model_name: str = ""
    #: The chat template of /v1/chat/completions: a Jinja file or the template text.
    chat_template: str = ""
    log_level: str = DEFAULT_LOG_LEVEL
    log_requests: bool = False
    hide_cached_tokens: bool = False
    core_in_process: bool = False
    dp: int = 1
    dp_policy: str = DEFAULT_ROUTER_POLICY
    max_body_bytes: int = 1 << 20
    body_read_timeout_s: float = 30.0
    max_prompt_chars: int = 200_000
    max_prompts_per_request: int = 64
    max_choices_per_request: int = 128
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_queued_requests: int = 256
    startup_timeout_s: float = 600.0
    #: Images (vision-language models; ``radixserve.server.images``).
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 32_000_000
    allow_image_urls: bool = False
    image_url_timeout_s: float = 10.0
    image_url_max_redirects: int = 3
    allow_private_image_urls: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        check_int(self, "port", 0, 65535)
        check_api_keys(self)
        if self.chat_template != "":
            from radixserve.chat_template import load_chat_template

            load_chat_template(self.chat_template)  # a missing file or a broken template fails now
        check_choice(self, "log_level")
        check_int(self, "image_url_max_redirects", 0, 20)
        check_float(self, "image_url_timeout_s", 0.001, 600.0)
        check_bools(self, ("log_requests", "hide_cached_tokens", "core_in_process", "allow_image_urls",
                           "allow_private_image_urls"))
        for name in ("max_body_bytes", "max_prompt_chars", "max_prompts_per_request", "max_choices_per_request",
                     "max_stop_string_chars", "max_images_per_request", "max_image_bytes", "max_image_pixels"):
            check_int(self, name, 1)
        for name in ("max_stop_strings", "max_stop_token_ids", "max_queued_requests"):
            check_int(self, name, 0)
        check_float(self, "startup_timeout_s", 1.0, 1e6)
        check_float(self, "body_read_timeout_s", 0.001, 1e6)
        check_int(self, "dp", 1, 256)
        check_choice(self, "dp_policy")
        if self.dp > 1 and self.core_in_process:
            raise ValueError("dp > 1 runs one engine-core process per rank: drop core_in_process")


__all__ = [
    "EngineConfig", "ServerConfig", "FIELD_HELP", "ATTENTION_BACKENDS", "CACHE_KINDS", "CHOICES",
    "CPU_ISAS", "DEFAULT_MODEL", "DEFAULT_POLICY", "DEFAULT_ROUTER_POLICY", "DTYPES",
    "HICACHE_PREFETCH_POLICIES", "HICACHE_WRITE_POLICIES", "ISA_ENV", "KV_CACHE_DTYPES",
    "LINEAR_BACKENDS", "LOG_LEVELS", "POLICIES", "ROUTER_POLICIES", "SPECULATIVE_KINDS",
    "THREAD_POLICIES", "WEIGHT_DTYPES", "check_api_keys", "check_bools", "check_choice",
    "check_float", "check_hicache", "check_int", "check_isa_name", "check_storage_url",
    "package_version",
]
