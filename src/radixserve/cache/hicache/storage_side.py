"""The tree's side of L3 (shared storage): page writes behind every new L2 copy, prefetch of
a request's pages beyond the local match, and the results of both, taken on the scheduler
thread.

Storage is not mirrored in the tree: it is asked, page by page along a request's key chain,
when a request arrives (``prefetch``); the pages fetched are handed to the tree
(``on_fetched``, inserted as an L2 run) when the request may be admitted (``ready``) or the
fetch completes (``poll``). ``node.in_l3`` only says this cache has stored (or fetched) the
pages that end inside a run, so they are not written twice. The threads
(:class:`~radixserve.storage.Prefetcher`, :class:`~radixserve.storage.Writer`) touch bytes
only, never the tree.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Hashable, List, Optional

import torch

from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.storage import (
    ModelFingerprint,
    PrefetchJob,
    Prefetcher,
    StorageClient,
    WriteItem,
    Writer,
    open_storage,
    page_keys,
)

from ..events import STORED, CacheEvent
from .config import HiCacheConfig
from .node import HiNode, PrefetchHandle
from .telemetry import Histogram

__all__ = ["StorageSide", "open_client"]

#: The counter a finished prefetch adds to, by its status.
_STATUS_COUNTERS = {"done": "prefetch_completed", "timed_out": "prefetch_timeouts", "cut": "prefetch_cut",
                    "cancelled": "prefetch_cancelled"}


def open_client(config: HiCacheConfig, kv_pool: KVPool, page_size: int) -> StorageClient:
    """The storage client of ``config.storage`` for the pool's model fingerprint."""
    if config.storage_page_tokens % page_size:
        raise ValueError(f"storage_page_tokens ({config.storage_page_tokens}) must be a "
                         f"multiple of page_size ({page_size})")
    backend = open_storage(config.storage, config.storage_timeout_s)
    fp = ModelFingerprint.for_pool(config.model_name, kv_pool, config.storage_page_tokens)
    return StorageClient(backend, fp, config.storage_retry_s)


class StorageSide:
    """L3 writes and prefetches for one tiered tree with storage; owns the storage threads and
    the prefetches in flight. Never touches the tree: fetched pages go to ``on_fetched``,
    events to ``emit``."""

    def __init__(self, storage: StorageClient, kv_pool: KVPool, host_pool: HostKVPool, page_size: int,
                 config: HiCacheConfig, counters: Dict[str, int], latency: Histogram,
                 on_fetched: Callable[[PrefetchHandle, list], None],
                 emit: Callable[[CacheEvent], None]) -> None:
        if not isinstance(storage, StorageClient):
            raise ValueError(f"storage must be a StorageClient, got {type(storage).__name__}")
        fp = storage.fingerprint
        if fp.page_tokens % page_size:
            raise ValueError(f"storage_page_tokens ({fp.page_tokens}) must be a multiple of the "
                             f"KV page size ({page_size})")
        want = (kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.kv_dtype)
        have = (fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype)
        if want != have:
            raise ValueError(f"storage fingerprint (layers, kv_heads, head_dim, dtype) {have} "
                             f"does not match the KV pool's {want}")
        self.storage = storage
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.config = config
        self.counters = counters
        self.latency = latency
        self._on_fetched = on_fetched
        self._emit = emit
        self.prefetching: Dict[int, PrefetchHandle] = {}
        self.prefetcher = Prefetcher(storage)
        self.writer = Writer(storage, config.write_queue_pages)

    @property
    def page_tokens(self) -> int:
        return self.storage.page_tokens

    # ------------------------------------------------------------------ writes
    def write_l3(self, nodes: List[HiNode]) -> None:
        """Queue the storage pages that end inside ``nodes`` (gathered now, written by the
        writer thread). A node whose pages were all queued is marked ``in_l3``."""
        storage = self.storage
        P = storage.page_tokens
        fp = storage.fingerprint
        for node in nodes:
            if node.in_l3 or node.key is None:
                continue
            path_nodes: List[HiNode] = []
            x = node
            while x.parent is not None:
                path_nodes.append(x)
                x = x.parent
            salt = x.salt
            path_nodes.reverse()
            e = sum(len(nd.key) for nd in path_nodes) >> 2
            s = e - (len(node.key) >> 2)
            first, last = s // P, e // P
            if first >= last:
                node.in_l3 = True
                continue
            path = b"".join(nd.key for nd in path_nodes)
            keys = page_keys(path[: last * P * 4], salt, fp)[first:]
            data = self._gather(path_nodes, first * P, last * P)
            # Page-first and contiguous here, so the writer thread only reads bytes: a torch
            # op on a second thread competes for the intra-op thread pool with the scheduler.
            L, _, T, H, D = data.shape
            pages = data.view(L, 2, T // P, P, H, D).permute(2, 0, 1, 3, 4, 5).contiguous()
            ok = True
            for j, (key, page) in enumerate(zip(keys, pages)):
                if self.writer.submit(WriteItem(key, page, (salt, path, (first + j + 1) * P))):
                    self.counters["l3_pages_enqueued"] += 1
                    self.counters["bytes_L2_to_L3"] += page.numel() * page.element_size()
                else:
                    self.counters["l3_pages_dropped"] += 1
                    ok = False
            node.in_l3 = ok

    def _gather(self, path_nodes: List[HiNode], a: int, b: int) -> torch.Tensor:
        """KV of tokens ``[a, b)`` of a root path, from whichever local tier holds each run,
        as a CPU tensor (what the storage writer encodes)."""
        parts = []
        pos = 0
        for nd in path_nodes:
            L = len(nd.key) >> 2
            lo, hi = max(a, pos), min(b, pos + L)
            if lo < hi:
                if nd.value is not None:
                    kv = self.kv_pool.kv
                    idx = torch.from_numpy(nd.value[lo - pos : hi - pos]).to(kv.device)
                    parts.append(kv.index_select(2, idx).cpu())
                else:
                    parts.append(self.host_pool.read(torch.from_numpy(nd.host[lo - pos : hi - pos])))
            pos += L
            if pos >= b:
                break
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, q: bytes, salt: Hashable, local: int) -> Optional[PrefetchHandle]:
        """See :meth:`.hiradix.HiRadixCache.prefetch`: ``q`` packed, ``local`` its tokens the
        local tiers hold."""
        P = self.storage.page_tokens
        n_pages = (len(q) >> 2) // P
        j0 = local // P
        if n_pages * P - local < self.config.prefetch_min_tokens or j0 >= n_pages:
            return None
        if not self.storage.healthy:
            self.counters["prefetch_skipped"] += 1
            return None
        tokens = q[: n_pages * P * 4]
        keys = page_keys(tokens, salt, self.storage.fingerprint)[j0:]
        job = PrefetchJob(keys)
        if not self.prefetcher.submit(job):
            self.counters["prefetch_skipped"] += 1
            return None
        h = PrefetchHandle(job, tokens, salt, j0 * P)
        self.prefetching[id(h)] = h
        self.counters["prefetch_started"] += 1
        return h

    def ready(self, handle: PrefetchHandle) -> bool:
        """See :meth:`.hiradix.HiRadixCache.prefetch_ready` (``handle`` is not finished)."""
        job = handle.job
        if job.done.is_set():
            self.finish(handle, "done")
            return True
        cfg = self.config
        if cfg.prefetch_policy == "best_effort":
            self.finish(handle, "cut")
            return True
        if cfg.prefetch_policy == "timeout" and time.monotonic() - job.t_submit >= cfg.prefetch_timeout_s:
            self.finish(handle, "timed_out")
            return True
        return False

    def wait_any(self, timeout_s: float) -> None:
        """Block until the oldest pending prefetch completes, at most ``timeout_s``."""
        for h in self.prefetching.values():
            h.job.wait(timeout_s)
            return

    def finish(self, h: PrefetchHandle, status: str) -> None:
        """End a prefetch (``status``: done, cut, timed_out or cancelled; "done" wins when the
        job completed meanwhile) and insert what it fetched."""
        job = h.job
        done = job.done.is_set()
        if not done:
            job.cancelled = True
        pages = job.pages[: len(job.pages)]
        h.finished = True
        h.status = status if not done or status == "cancelled" else "done"
        h.fetched = len(pages)
        h.present = job.present
        self.prefetching.pop(id(h), None)
        end_t = job.t_done if done and job.t_done is not None else time.monotonic()
        self.latency.observe(end_t - job.t_submit)
        c = self.counters
        c[_STATUS_COUNTERS[h.status]] += 1
        c["prefetch_pages"] += len(pages)
        if pages:
            self._on_fetched(h, pages)

    # ------------------------------------------------------------------ per step
    def poll(self) -> None:
        """Insert finished prefetches; account L3 write results."""
        if self.prefetching:
            for h in list(self.prefetching.values()):
                if h.job.done.is_set():
                    self.finish(h, "done")
        done = self.writer.done
        while done:
            (salt, path, end), ok = done.popleft()
            if ok:
                self.counters["l3_pages_stored"] += 1
                self._emit(CacheEvent(STORED, salt, path[: end << 2], self.storage.page_tokens, "L3"))
            else:
                self.counters["l3_pages_failed"] += 1

    def close(self) -> None:
        """Stop the threads (queued writes get the writer's timeout to finish), disconnect."""
        for h in list(self.prefetching.values()):
            h.job.cancelled = True
        self.prefetcher.close()
        self.writer.close()
        self.storage.close()
