"""Every option of radixserve, declared once: two frozen dataclasses validated on construction.

* :class:`EngineConfig` — what the engine core needs (model, cache, scheduling, memory).
  ``Engine(config)`` takes it; the engine-core process is started from it.
* :class:`ServerConfig` — what the API process needs (address, keys, limits, logging).

Each field is also a CLI flag (``cli.py`` derives ``--flag`` names, types, choices and help
from the dataclass and ``FIELD_HELP``), so a new option is one field here and nothing else.
Validation raises ``ValueError`` naming the field, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse


DEFAULT_MODEL = "smollm2-135m"
CACHE_KINDS = ("radix", "table", "none")
POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
DTYPES = ("float32", "bfloat16", "auto")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
ATTENTION_BACKENDS = ("torch", "torch-eager")
CPU_ISAS = ("auto", "generic", "avx2", "avx512")  # instruction-set levels, lowest first, after "auto"
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
#: model's weights, or computed with integer dot products), per-channel int8, or dense.
WEIGHT_DTYPES = ("auto", "gguf", "gguf-q8", "int8", "dense")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
ROUTER_POLICIES = ("cache_aware", "round_robin", "shortest_queue", "prefix_hash", "random")
#: Speculative decoding: off, or drafts from the radix tree (radixserve.sched.speculation).
SPECULATIVE_KINDS = ("none", "ngram-tree")
#: Torch threads a step runs on: the configured count always, or fewer while other processes
#: use the cores (radixserve.engine.threads).
THREAD_POLICIES = ("adaptive", "fixed")


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
    "thread_policy": THREAD_POLICIES,
}


def _check_choice(obj: Any, name: str, choices: tuple[str, ...] | None = None) -> None:
    v, choices = getattr(obj, name), choices or CHOICES[name]
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")


def _check_int(obj: Any, name: str, lo: int, hi: int | None = None) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {bound}, got {v!r}")


def check_api_keys(obj: Any) -> None:
    """Validate (and normalise to a tuple) ``api_key``, ``api_key_file`` and ``admin_key`` of
    a frozen config: the server's and the router's (which must map keys to tenants as the
    servers behind it do) take the same fields."""
    keys = obj.api_key
    if isinstance(keys, str):
        object.__setattr__(obj, "api_key", (keys,))
    elif not isinstance(keys, (tuple, list)):
        raise ValueError(f"api_key must be a list of keys, got {keys!r}")
    else:
        object.__setattr__(obj, "api_key", tuple(keys))
    for k in obj.api_key:
        if not isinstance(k, str) or not k.strip():
            raise ValueError("api_key must not be empty (an empty key would disable authentication)")
    if not isinstance(obj.api_key_file, str):
        raise ValueError(f"api_key_file must be a path, got {obj.api_key_file!r}")
    if obj.api_key_file and not os.path.isfile(obj.api_key_file):
        raise ValueError(f"api_key_file {obj.api_key_file!r} does not exist")
    if not isinstance(obj.admin_key, str):
        raise ValueError(f"admin_key must be a string, got {obj.admin_key!r}")


def _check_float(obj: Any, name: str, lo: float, hi: float) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")


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
    _check_int(obj, p + "l2_tokens", 0)
    _check_int(obj, p + "ghost_entries", 0)
    for name in ("write_through_threshold", "prefetch_min_tokens", "storage_page_tokens", "write_queue_pages"):
        _check_int(obj, p + name, 1)
    _check_choice(obj, p + "write_policy", HICACHE_WRITE_POLICIES)
    _check_choice(obj, p + "prefetch_policy", HICACHE_PREFETCH_POLICIES)
    _check_float(obj, p + "prefetch_timeout_s", 0.0, 3600.0)
    _check_float(obj, p + "storage_timeout_s", 1e-3, 1e6)
    _check_float(obj, p + "storage_retry_s", 0.0, 1e6)
    if getattr(obj, p + "storage") not in (None, ""):
        check_storage_url(getattr(obj, p + "storage"), p + "storage")
        if not getattr(obj, p + "l2_tokens"):
            raise ValueError(f"{p}storage needs {p}l2_tokens > 0 (L2 stages every L3 transfer)")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    cache: str = "radix"
    policy: str = "lpm"
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
    #: A decode row's cost relative to a decode step's fixed cost (sched/speculation.allocate).
    speculative_row_cost: float = 0.25
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
            _check_choice(self, name)
        for name in ("page_size", "kv_cache_tokens", "max_running_requests", "max_prefill_tokens",
                     "chunked_prefill_size", "lpm_fallback_queue_len", "lpm_max_passes",
                     "in_batch_sharing_min_tokens"):
            _check_int(self, name, 1)
        if self.cpu_isa == "auto":
            # a bad $RADIXSERVE_CPU_ISA is an error now, not at model load
            check_isa_name(os.environ.get(ISA_ENV, "") or "auto", ISA_ENV)
        _check_int(self, "num_threads", 0)
        _check_int(self, "swa_kv_cache_tokens", 0)
        _check_int(self, "mamba_snapshots", 0)
        _check_int(self, "mamba_snapshot_interval", 0)
        _check_int(self, "max_context_len", 0)
        _check_int(self, "decode_reserve_clip", 0)
        _check_int(self, "seed", 0, 2**63 - 1)
        _check_float(self, "decode_reserve_ratio", 0.0, 1.0)
        _check_float(self, "lpm_max_wait_s", 0.0, 1e9)
        _check_float(self, "session_ttl_s", 0.0, 1e6)
        _check_int(self, "max_sessions", 1)
        _check_int(self, "image_cache_bytes", 0)
        for name in ("mixed_steps", "in_batch_sharing", "hybrid_kv", "grammar_fast_forward", "image_content_keys"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
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
        _check_choice(self, "speculative")
        _check_int(self, "num_draft_tokens", 1, 64)
        _check_int(self, "speculative_min_ngram", 1, 64)
        _check_int(self, "speculative_max_ngram", self.speculative_min_ngram, 64)
        _check_float(self, "speculative_row_cost", 0.0, 100.0)
        if self.speculative == "none":
            return
        # The one validated configuration: the plain or hybrid radix tree on one rank.
        if self.cache != "radix":
            raise ValueError(f"speculative={self.speculative!r} drafts from the radix tree: it needs "
                             f"cache='radix', got {self.cache!r}")
        if self.hicache_l2_tokens:
            raise ValueError(f"speculative={self.speculative!r} is not supported with hicache_l2_tokens "
                             f"yet (the draft index follows the L1 tree only)")
        if self.tp_size > 1:
            raise ValueError(f"speculative={self.speculative!r} is not supported with tp_size > 1 yet (verification "
                             f"is not validated bit for bit across sharded ranks); drop --tp, or run several "
                             f"speculating engine cores with --dp")

    def _check_parallel(self) -> None:
        _check_int(self, "tp_size", 1, 1024)
        _check_int(self, "nnodes", 1, 1024)
        _check_int(self, "node_rank", 0, self.nnodes - 1)
        _check_float(self, "dist_timeout_s", 1.0, 1e6)
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
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: tuple[str, ...] = ()
    api_key_file: str = ""
    admin_key: str = ""
    served_model_name: str = ""
    #: The chat template of /v1/chat/completions: a Jinja file or the template text.
    chat_template: str = ""
    log_level: str = "info"
    log_requests: bool = False
    hide_cached_tokens: bool = False
    core_in_process: bool = False
    dp: int = 1
    dp_policy: str = "cache_aware"
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
        _check_int(self, "port", 0, 65535)
        check_api_keys(self)
        if self.chat_template != "":
            from radixserve.chat_template import load_chat_template

            load_chat_template(self.chat_template)  # a missing file or a broken template fails now
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
            _check_int(self, name, 1)
        _check_int(self, "image_url_max_redirects", 0, 20)
        _check_float(self, "image_url_timeout_s", 0.001, 600.0)
        for name in ("log_requests", "hide_cached_tokens", "core_in_process", "allow_image_urls",
                     "allow_private_image_urls"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_body_bytes", "max_prompt_chars", "max_prompts_per_request",
                     "max_choices_per_request", "max_stop_string_chars"):
            _check_int(self, name, 1)
        for name in ("max_stop_strings", "max_stop_token_ids", "max_queued_requests"):
            _check_int(self, name, 0)
        _check_float(self, "startup_timeout_s", 1.0, 1e6)
        _check_float(self, "body_read_timeout_s", 0.001, 1e6)
        _check_int(self, "dp", 1, 256)
        _check_choice(self, "dp_policy")
        if self.dp > 1 and self.core_in_process:
            raise ValueError("dp > 1 runs one engine-core process per rank: drop core_in_process")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
CHOICES["log_level"] = LOG_LEVELS

FIELD_HELP: dict[str, str] = {
    # engine
    "model": "model name (smollm2-135m, gemma3-270m; tiny-random, tiny-random-gemma3 and tiny-random-llava for tests) or path to a .gguf file or a Hugging Face folder",
    "cache": "prefix cache: radix (RadixAttention), table (flat ablation) or none",
    "policy": "scheduling order of waiting requests: lpm (longest prefix match), dfs-weight, fcfs, random",
    "dtype": "weights dtype: float32, bfloat16, or auto (by CPU features, never a timing: bfloat16 where "
             "the vector kernels run, float32 on the portable path; the choice and why are logged and in "
             "/server_info)",
    "device": "torch device for weights and the KV pool (cpu, cuda, ...)",
    "attention_backend": "attention implementation: torch (fused CPU kernels when they build, else eager) "
                         "or torch-eager (the reference path)",
    "cpu_isa": "highest instruction set the CPU kernels may use: generic (portable C++), avx2, avx512, or "
               "auto ($RADIXSERVE_CPU_ISA if set, else the best this CPU has); lower levels run and test the "
               "paths of lesser CPUs",
    "linear_backend": "how the linear layers run: radixserve (the kernels' packed GEMM, batch-invariant: "
                      "float32 fma chains for a float32 model, bfloat16 dot products for a bfloat16 one), "
                      "onednn (torch's oneDNN on reordered weights; NOT batch-invariant: a request's "
                      "output depends on what else is in its batch), torch (F.linear; NOT batch-invariant "
                      "on CPU), or auto (radixserve wherever the kernels build)",
    "weight_dtype": "how the linear weights are held: gguf (a GGUF's quantized blocks as shipped, computed "
                    "directly: the same tokens and logprobs as the dense bfloat16 model of that file, at a "
                    "quarter to a half of its bytes per decode step), gguf-q8 (the same blocks computed with "
                    "integer dot products against activations quantized to 8 bits per 32-block, as llama.cpp "
                    "does: Q8_0, Q4_0 and Q4_1 tensors, other formats as with gguf; exact to its own stated "
                    "definition, batch-invariant, not the dense model's bits), int8 (per-output-channel int8, "
                    "weight-only, from any source), dense (every weight in --dtype), or auto (gguf for a "
                    "GGUF served in bfloat16 on the kernels, else dense; by CPU features and the file, "
                    "never a timing: the choice and why are logged and in /server_info)",
    "page_size": "tokens per KV page; the cache matches and stores whole pages",
    "kv_cache_tokens": "KV pool capacity in tokens, shared by the cache and running requests",
    "kv_cache_dtype": "KV pool storage: auto (the weights' dtype), float32, bfloat16, or int8 / fp8_e4m3 "
                      "(one float32 scale per token and KV head, written with the K/V: no calibration)",
    "swa_kv_cache_tokens": "models with sliding-window layers: their KV pool in tokens, beside the "
                           "full-attention one (0 = auto: a window per running request, at least a quarter "
                           "of kv_cache_tokens)",
    "hybrid_kv": "models with sliding-window layers: a KV pool per kind, sliding-window KV kept only "
                 "where a window reads it (off: every layer's KV for every cached token, the "
                 "full-attention layout)",
    "mamba_snapshots": "models with Mamba layers: state snapshots the prefix cache keeps (a prefix is "
                       "reused only up to its deepest snapshot); 0 = auto (max_running_requests)",
    "mamba_snapshot_interval": "models with Mamba layers: also snapshot the state at every multiple of this "
                               "many tokens inside a prompt being prefilled (its chunks are cut there), so a "
                               "later prompt sharing only part of a long one resumes near where they part; "
                               "these snapshots count against --mamba-snapshots; 0 = off (snapshots at request "
                               "ends and branch points only)",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "most new prompt tokens computed in one step",
    "chunked_prefill_size": "longer prompts are prefilled in chunks of this many tokens",
    "max_context_len": "longest prompt + output in tokens (0 = the model's context length)",
    "mixed_steps": "run decode tokens and a prefill chunk in the same step",
    "lpm_fallback_queue_len": "above this many waiting requests, lpm falls back to fcfs",
    "lpm_max_wait_s": "lpm: a request waiting longer than this goes ahead of longer matches",
    "lpm_max_passes": "lpm: a request passed over by this many later arrivals goes ahead",
    "decode_reserve_ratio": "share of each request's max_tokens reserved at admission",
    "decode_reserve_clip": "a request's decode reservation is at most this many tokens",
    "in_batch_sharing": "run one of several requests sharing an uncached prefix first",
    "in_batch_sharing_min_tokens": "shortest shared uncached prefix that makes a request wait a step",
    "session_ttl_s": "requests with a session id keep their conversation's cached KV (for a sliding-window "
                     "model: its window) locked until the session's next turn, its close, or this many "
                     "seconds without a request (0 = sessions off); under memory pressure sessions yield",
    "max_sessions": "most sessions holding KV at once; a new one ends the least recently used",
    "seed": "seed for requests without their own seed",
    "grammar_fast_forward": "structured outputs: compute the tokens a grammar forces in one step "
                            "(same output as one token per step)",
    "speculative": "speculative decoding: ngram-tree drafts each decoding request's next tokens from "
                   "what followed its last few tokens in the radix tree of its tenant (every prompt "
                   "and answer the server holds) or earlier in its own output, and verifies them in "
                   "the same step; the same tokens and logprobs as without it (seeded sampling "
                   "included), a request whose drafts miss backs off; needs --cache radix, no "
                   "HiCache tiers, one rank per core (--dp is fine, --tp is not), and the batch-invariant "
                   "kernels; none = off",
    "num_draft_tokens": "speculative decoding: most draft tokens a request verifies in one step "
                        "(adapted per request to what it gets accepted)",
    "speculative_min_ngram": "speculative decoding: shortest suffix of a request's tokens looked up "
                             "as a draft's context",
    "speculative_max_ngram": "speculative decoding: longest suffix looked up (the longest found wins)",
    "speculative_row_cost": "speculative decoding: what one more row costs a decode step, as a share of "
                            "the step's fixed cost (a pass over the weights); draft tokens are verified "
                            "only while their expected acceptance pays for their rows, so big batches "
                            "draft less. Measure it as (t8 / t1 - 1) / 7 from decode step times at batch "
                            "1 and 8",
    "image_content_keys": "images: key image tokens by a hash of the pixels, so the same image in "
                          "another request hits (off: image tokens are never shared)",
    "image_cache_bytes": "images: bytes of vision-encoder outputs kept by image hash (0 = off)",
    "num_threads": "torch CPU threads for the model (0 = one per core)",
    "thread_policy": "adaptive: run a step on fewer threads while other processes use the cores "
                     "(spinning threads that wait on a descheduled sibling make a step many times "
                     "slower; the results are the same bits on any thread count); fixed: always "
                     "--num-threads",
    "kv_events_endpoint": "ZMQ endpoint where the engine publishes its cache events (for a router); "
                          "empty = off",
    "hicache_l2_tokens": "HiCache: host-memory (L2) tier below the KV pool, in tokens (0 = off)",
    "hicache_storage": "HiCache: shared storage (L3) below L2: file:///path or redis://host:port/db",
    "hicache_write_policy": "HiCache: when KV is copied down to L2: write_through, write_through_selective "
                            "(after --hicache-write-through-threshold hits) or write_back (on eviction)",
    "hicache_write_through_threshold": "HiCache: hits before write_through_selective copies a run to L2",
    "hicache_prefetch_policy": "HiCache: a request whose prefix is in L3 waits for the fetch: best_effort "
                               "(not at all), wait_complete, or timeout",
    "hicache_prefetch_timeout_s": "HiCache: longest wait for an L3 prefetch (timeout policy)",
    "hicache_storage_page_tokens": "HiCache: tokens per storage object (L3 page), a multiple of "
                                   "page_size; a prefix shorter than one is never stored",
    "hicache_prefetch_min_tokens": "HiCache: skip a prefetch when storage could add fewer tokens than this",
    "hicache_write_queue_pages": "HiCache: pages waiting to be written to L3 before new ones are dropped "
                                 "(and counted)",
    "hicache_storage_timeout_s": "HiCache: socket timeout of one storage call (Redis)",
    "hicache_storage_retry_s": "HiCache: after a failed storage call, storage is skipped this long",
    "hicache_ghost_entries": "HiCache: evicted prefixes remembered to tell 'evicted' from 'never seen' in "
                             "miss telemetry",
    "tp_size": "tensor parallelism: ranks the model is sharded over (heads, MLP, vocabulary); rank 0 "
               "schedules and samples, the others run its steps on their shards",
    "nnodes": "tensor parallelism over several machines: how many (tp_size ranks split evenly)",
    "node_rank": "this machine's index among nnodes; node 0 serves HTTP and runs rank 0, the others "
                 "run only their worker ranks",
    "dist_init_addr": "HOST:PORT where rank 0 listens for the other ranks (needed with nnodes > 1; "
                      "default: loopback, any free port)",
    "dist_timeout_s": "tensor parallelism: longest wait in a collective or for a rank to start",
    # server
    "host": "address to bind",
    "port": "port to bind; 0 picks a free one",
    "api_key": "require 'Authorization: Bearer KEY'; repeat for several keys, as KEY or KEY:TENANT",
    "api_key_file": "file of API keys, one 'KEY[:TENANT]' per line ('#' comments)",
    "admin_key": "key for admin routes (/flush_cache, /abort_request of any request, /metrics)",
    "served_model_name": "model name reported by the API (default: --model)",
    "chat_template": "chat template of /v1/chat/completions, a Jinja file or the template text, in place "
                     "of the model's; a model that ships none (a base model) answers chat requests with "
                     "400 unless one is given",
    "log_level": "log level",
    "log_requests": "log prompt text of each request (off: only sizes and timings)",
    "hide_cached_tokens": "always report 0 cached tokens (no cache side channel at all)",
    "core_in_process": "run the engine core on a thread of the API process instead of its own process",
    "dp": "data parallelism: engine-core processes behind this server, each with its own cache and "
          "KV pool (kv_cache_tokens each) and an equal share of the threads; requests go to the core "
          "whose cache holds most of their prompt, given the queues",
    "dp_policy": "how requests are spread over the dp cores: cache_aware, round_robin, shortest_queue, "
                 "prefix_hash or random",
    "max_body_bytes": "largest request body accepted (413 above; base64 images count at 4/3 their size)",
    "body_read_timeout_s": "time a client has to send a request's whole body once its headers are in "
                           "(408 and the connection closed after it: a body announced and never sent "
                           "would hold the connection forever)",
    "max_images_per_request": "images: most images in one request (400 above)",
    "max_image_bytes": "images: largest encoded image, after base64 decoding or fetching (400 above)",
    "max_image_pixels": "images: most pixels in one image, checked before decoding (400 above)",
    "allow_image_urls": "images: fetch http(s) image URLs (off: data URIs and base64 only), from public "
                        "addresses only (every address the host resolves to, and each redirect's, is "
                        "checked; no proxy)",
    "allow_private_image_urls": "images: let image URLs reach loopback, private, link-local and other "
                                "non-public addresses too (the server then fetches from its own network "
                                "whatever a client names)",
    "image_url_timeout_s": "images: time limit for fetching one image URL",
    "image_url_max_redirects": "images: most redirects followed when fetching an image URL",
    "max_prompt_chars": "longest prompt or message text, in characters, checked before tokenizing",
    "max_prompts_per_request": "most prompts in one request",
    "max_choices_per_request": "most choices (n x prompts) in one request",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_chars": "longest stop string",
    "max_stop_token_ids": "most stop token ids per request",
    "max_queued_requests": "requests waiting beyond the running ones before new ones get 429",
    "startup_timeout_s": "seconds to wait for the engine core to load the model",
}

__all__ = [
    "ATTENTION_BACKENDS", "CACHE_KINDS", "SPECULATIVE_KINDS", "CPU_ISAS", "LINEAR_BACKENDS", "HICACHE_PREFETCH_POLICIES", "HICACHE_WRITE_POLICIES", "ROUTER_POLICIES", "CHOICES", "DEFAULT_MODEL", "DTYPES", "EngineConfig",
    "FIELD_HELP", "LOG_LEVELS", "POLICIES", "ServerConfig", "check_api_keys", "check_hicache", "check_storage_url",
]
