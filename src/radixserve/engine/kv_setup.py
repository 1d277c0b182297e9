"""The engine core's KV slots and prefix cache, chosen from the config and the model.

Kept apart from the core's request handling: which allocator and which cache a model gets
(one pool, or one per attention kind for a model with sliding-window layers; the plain tree,
the sliding-window tree or the tiered HiCache) is decided once, at startup.
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.cache import make_cache
from radixserve.cache.swa import SWARadixCache
from radixserve.config import EngineConfig
from radixserve.memory import SlotAllocator
from radixserve.memory.quant import row_elems, storage_dtype
from radixserve.memory.swa import HybridAllocator
from radixserve.model.config import ModelConfig

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


def make_prefix_cache(cfg: EngineConfig, allocator: SlotAllocator, kv_pool: Any,  # noqa: ANN201
                      weights: str = "dense"):
    """The prefix cache over ``allocator``'s slots (``kv_pool``: what HiCache copies to and
    from its host tier). ``weights``: the weight format the model computes in; a quantized one
    is part of the shared storage's fingerprint, so KV pages from another format never hit
    (dense weights keep the model:dtype name)."""
    if isinstance(allocator, HybridAllocator):
        if cfg.cache == "radix":
            return SWARadixCache(allocator, allocator.window)
        return make_cache(cfg.cache, page_size=cfg.page_size, on_free=allocator.free)
    if not cfg.hicache_l2_tokens:
        return make_cache(cfg.cache, page_size=cfg.page_size, on_free=allocator.free)
    from radixserve.cache.hicache import HiCacheConfig, HiRadixCache

    name = f"{cfg.model}:{cfg.dtype}" + ("" if weights == "dense" else f":weights={weights}")
    cache = HiRadixCache.from_config(HiCacheConfig.from_engine(cfg, model_name=name), allocator, kv_pool)
    cache.on_written = allocator.mark_written  # L2 -> L1 loads hold K/V
    return cache
