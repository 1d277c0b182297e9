"""The engine core's KV slots, Mamba state pool and prefix cache, chosen from the config and
the model.

Kept apart from the core's request handling: which allocator and which cache a model gets
(one pool, or one per attention kind for a model with sliding-window layers; a state pool for
a model with Mamba layers; the plain tree, the sliding-window tree, the Mamba tree or the
tiered HiCache) is decided once, at startup, and so is what such a model refuses.
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.cache import make_cache
from radixserve.cache.mamba import MambaRadixCache
from radixserve.cache.swa import SWARadixCache
from radixserve.config import EngineConfig
from radixserve.memory import SlotAllocator
from radixserve.memory.mamba import MambaStatePool
from radixserve.memory.quant import row_elems, storage_dtype
from radixserve.memory.swa_pool import HybridAllocator
from radixserve.model.model_config import ModelConfig

log = logging.getLogger("radixserve.engine")


def make_allocator(cfg: EngineConfig, mc: ModelConfig, kv_dtype: str) -> SlotAllocator:
    """Slots of the KV pool; for a model with sliding-window and full-attention layers, a
    pool per kind (a full-attention layout would spend the sliding layers' bytes on
    tokens no window reads)."""
    windows = {mc.layer_window(i) for i in range(mc.num_layers)}
    if windows == {0} or 0 not in windows or not cfg.hybrid_kv:
        return SlotAllocator(cfg.kv_cache_tokens, cfg.page_size)
    for bad, why in ((cfg.cache == "table", "cache='table' (a table cannot tell which window KV is left)"),
                     (cfg.hicache_l2_tokens > 0, "hicache_l2_tokens > 0 (HiCache tiers do not carry "
                                                 "sliding-window KV yet)"),
                     (cfg.tp_size > 1, "tp_size > 1")):
        if bad:
            raise ValueError(f"model {cfg.model!r} has sliding-window layers; not supported with {why}")
    # Auto: room for every running request's window (and one more) and a prefill chunk,
    # at least a quarter of the full pool.
    need = (cfg.max_running_requests + 1) * (mc.sliding_window + cfg.page_size) + cfg.chunked_prefill_size
    swa = cfg.swa_kv_cache_tokens or min(cfg.kv_cache_tokens, max(cfg.kv_cache_tokens // 4, need))
    alloc = HybridAllocator(cfg.kv_cache_tokens, swa, cfg.page_size, window=mc.sliding_window)
    n_swa = sum(1 for i in range(mc.num_layers) if mc.layer_window(i))
    per_tok = 2 * mc.num_kv_heads * row_elems(kv_dtype, mc.head_dim) * storage_dtype(kv_dtype).itemsize
    nbytes = per_tok * ((mc.num_layers - n_swa) * alloc.capacity + n_swa * alloc.swa.capacity)
    full_layout = nbytes // (per_tok * mc.num_layers)
    log.info("hybrid KV: %d full-attention tokens (%d layers) + %d sliding-window tokens (%d layers, "
             "window %d) in %.1f MiB; a full-attention layout holds %d tokens in as much memory, "
             "this one %.2fx as many", alloc.capacity, mc.num_layers - n_swa, alloc.swa.capacity, n_swa,
             mc.sliding_window, nbytes / 2**20, full_layout, alloc.capacity / max(1, full_layout))
    return alloc


def make_state_pool(cfg: EngineConfig, mc: ModelConfig) -> MambaStatePool | None:
    """The Mamba state pool of a model with Mamba layers (None for others): a slot for every
    request that can run at once (the one whose prefill is chunked counts among them) and for
    the snapshots the radix cache may keep (``mamba_snapshots``). Speculative decoding needs
    no slots of its own: a verification step stages its states and replays the kept positions
    (``radixserve.model.arch.bamba.VerifiedScan``). ValueError, naming the option, for what
    such a model cannot be served with yet."""
    if not mc.mamba_layers:
        return None
    for bad, why in (
            (cfg.cache == "table", ("cache='table' (a table of whole sequences keeps no state snapshots; use "
                                    "cache 'radix' or 'none')")),
            (cfg.hicache_l2_tokens > 0 or bool(cfg.hicache_storage),
             "hicache_l2_tokens / hicache_storage (HiCache tiers do not carry Mamba state snapshots)"),
            (cfg.tp_size > 1, "tp_size > 1 (tensor parallelism does not shard Mamba layers)"),
            (cfg.kv_cache_dtype in ("int8", "fp8_e4m3"),
             (f"kv_cache_dtype={cfg.kv_cache_dtype!r} (quantized KV is not implemented for this model; use auto, "
              "float32 or bfloat16)")),
            (cfg.weight_dtype in ("int8", "gguf", "gguf-q8", "gguf-codes"),
             f"weight_dtype={cfg.weight_dtype!r} (its Mamba layers run dense weights only; use auto or dense)"),
            (cfg.page_size != 1, f"page_size={cfg.page_size} (a state snapshot ends on an exact token; use 1)")):
        if bad:
            raise ValueError(f"model {cfg.model!r} has Mamba layers; not supported with {why}")
    from radixserve.model.arch.bamba import make_state_pool as shaped_pool

    snapshots = (cfg.mamba_snapshots or cfg.max_running_requests) if cfg.cache == "radix" else 0
    pool = shaped_pool(mc, cfg.max_running_requests + snapshots, cfg.device)
    log.info("Mamba state: %d slots of %.2f MiB (%d layers): %d for running requests (a prefilling one included), "
             "%d for snapshots", pool.capacity, pool.bytes_per_slot / 2**20, pool.num_layers,
             cfg.max_running_requests, snapshots)
    return pool


def make_prefix_cache(cfg: EngineConfig, allocator: SlotAllocator, kv_pool: Any,  # noqa: ANN201
                      weights: str = "dense", states: MambaStatePool | None = None):
    """The prefix cache over ``allocator``'s slots (``kv_pool``: what HiCache copies to and
    from its host tier). ``weights``: the weight format the model computes in; a quantized one
    is part of the shared storage's fingerprint, so KV pages from another format never hit
    (dense weights keep the model:dtype name). ``states``: a Mamba model's state pool
    (:func:`make_state_pool`), whose snapshots the radix cache keeps."""
    if states is not None and cfg.cache == "radix":
        return MambaRadixCache(states, cfg.mamba_snapshots or cfg.max_running_requests, cfg.page_size,
                               on_free=allocator.free)
    if isinstance(allocator, HybridAllocator) and cfg.cache == "radix":
        return SWARadixCache(allocator, allocator.window)
    if isinstance(allocator, HybridAllocator) or not cfg.hicache_l2_tokens:
        return make_cache(cfg.cache, page_size=cfg.page_size, on_free=allocator.free)
    from radixserve.cache.hicache import HiCacheConfig, HiRadixCache

    name = f"{cfg.model}:{cfg.dtype}" + ("" if weights == "dense" else f":weights={weights}")
    cache = HiRadixCache.from_config(HiCacheConfig.from_engine(cfg, model_name=name), allocator, kv_pool)
    cache.on_written = allocator.mark_written  # L2 -> L1 loads hold K/V
    return cache
