"""Free list of KV slots, handed out in whole pages.

Slots are the unit the attention kernels index; pages are the unit the allocator and the
prefix cache reason about. With ``page_size == 1`` the two coincide (the paper's setting).
A request's slots need not be contiguous: the model reads K/V by slot index, which is what
lets a cached prefix be shared by any number of requests without a copy.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """A free list of ``capacity`` KV slots, allocated in whole pages.

    The free list is kept as one int64 tensor of free page ids so that allocating or freeing
    thousands of slots is a handful of tensor operations, never a per-slot Python loop.
    """

    def __init__(self, capacity: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if capacity < page_size:
            raise ValueError(f"capacity must be >= page_size ({page_size}), got {capacity}")
        self.page_size = page_size
        self.num_pages = capacity // page_size
        self.capacity = self.num_pages * page_size
        self.device = torch.device(device)
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    @property
    def available(self) -> int:
        """Free slots (a multiple of page_size)."""
        return int(self._free_pages.numel()) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` tokens, rounded up to whole pages; None if not enough.

        The returned tensor holds ``pages * page_size`` slot indices, page after page; the
        caller uses the first ``num_tokens`` and must eventually free all of them.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        n_pages = self.pages_for(num_tokens)
        if n_pages > self._free_pages.numel():
            return None
        pages = self._free_pages[:n_pages]
        self._free_pages = self._free_pages[n_pages:]
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the free list. Partial pages are not allowed: free whole pages."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).reshape(-1).cpu()
        if self.page_size == 1:
            pages = indices
        else:
            if indices.numel() % self.page_size:
                raise ValueError(
                    f"free() needs whole pages: {indices.numel()} slots with page_size {self.page_size}"
                )
            pages = indices[:: self.page_size] // self.page_size
        self._free_pages = torch.cat([self._free_pages, pages])

    def reset(self) -> None:
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)

    def free_slot_set(self) -> set[int]:
        """All free slot ids (debugging and integrity checks only: O(capacity))."""
        return set(
            (self._free_pages[:, None] * self.page_size + self._offsets).reshape(-1).tolist()
        )
