"""Free list of KV slots, handed out in whole pages.

Slots are what the attention kernels index; pages what the allocator and the prefix cache
reason about (``page_size == 1``, the paper's setting, makes them one). A request's slots
need not be contiguous: the model reads K/V by slot index, so a cached prefix is shared by
any number of requests without a copy.

They had better be *mostly* contiguous, though: decode attention reads every context row of
every running request at every step, and rows scattered over the pool cost TLB misses and
defeat the hardware prefetcher (``benchmarks/bench_model.py`` measures shuffled against
in-order slots). So freed pages wait in a release list, and when the sorted free list runs
short the two are merged and sorted, once (as in SGLang's allocator). Allocation walks the
pool in ascending order, so a request's pages come out in long ascending runs even after
long churn, where a FIFO free list would scatter them (``tests/test_allocator.py``).
"""

from __future__ import annotations

import torch

# Frees kept apart before they are merged into the free list even if it is not short.
_MAX_RELEASED = 4096


class SlotAllocator:
    """A free list of ``capacity`` KV slots, allocated in whole pages: one sorted int64 tensor
    of free page ids (plus the tensors freed since the last merge), so that allocating or
    freeing thousands of slots is a handful of tensor operations, never a per-slot loop."""

    def __init__(self, capacity: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if capacity < page_size:
            raise ValueError(f"capacity must be >= page_size ({page_size}), got {capacity}")
        self.page_size = page_size
        self.num_pages = capacity // page_size
        self.capacity = self.num_pages * page_size
        self.device = torch.device(device)
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self.reset()

    @property
    def available(self) -> int:
        """Free slots (a multiple of page_size)."""
        return (int(self._free_pages.numel()) + self._num_released) * self.page_size

    def _merge_released(self) -> None:
        """Fold the pages freed since the last merge into the free list, sorted."""
        if self._released:
            merged = torch.cat([self._free_pages, *self._released])
            self._free_pages = torch.sort(merged).values
            self._released = []
            self._num_released = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` tokens, rounded up to whole pages (``pages * page_size``
        indices, page after page: the caller uses the first ``num_tokens`` and frees all of
        them); None if not enough."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        n_pages = self.pages_for(num_tokens)
        if n_pages > self._free_pages.numel():
            if n_pages > self._free_pages.numel() + self._num_released:
                return None
            self._merge_released()
        pages = self._free_pages[:n_pages]
        self._free_pages = self._free_pages[n_pages:]
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def mark_written(self, indices: torch.Tensor) -> None:
        """Record that ``indices`` now hold computed K/V (after a forward pass succeeded). Only
        written slots may enter the prefix cache (the scheduler's integrity check asks
        ``all_written`` of every slot it holds), so a slot taken for a step that then failed
        can never be served to a later request."""
        if indices.numel():
            self.written[indices] = True

    def all_written(self, indices: torch.Tensor) -> bool:
        return bool(indices.numel() == 0 or self.written[indices].all())

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the free list. Partial pages are not allowed: free whole pages."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).reshape(-1).cpu()
        self.written[indices] = False
        if self.page_size == 1:
            pages = indices.clone()  # the caller may reuse its tensor; the list keeps ours
        else:
            if indices.numel() % self.page_size:
                raise ValueError(f"free() needs whole pages: {indices.numel()} slots with page_size "
                                 f"{self.page_size}")
            pages = indices[:: self.page_size] // self.page_size
        self._released.append(pages)
        self._num_released += int(pages.numel())
        if len(self._released) > _MAX_RELEASED:
            self._merge_released()  # bound the list; a sort of the free list, now and then

    def reset(self) -> None:
        self.written = torch.zeros(self.capacity, dtype=torch.bool)
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    def free_slot_set(self) -> set[int]:
        """All free slot ids (debugging and integrity checks only: O(capacity))."""
        pages = torch.cat([self._free_pages, *self._released])
        return set((pages[:, None] * self.page_size + self._offsets).reshape(-1).tolist())
