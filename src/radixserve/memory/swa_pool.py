"""Slots of a hybrid model: a full-attention slot per token, and a sliding-window slot beside
it only while some window can still read it.

The scheduler, the requests and the radix tree deal in full slots only, as for a
full-attention model. Each full slot ``f`` may have a sliding-window (SWA) slot
``swa_map[f]`` in the smaller SWA pool (read by the sliding layers), or -1 once that KV is
gone (out of every live window, or a tombstone of the tree): the two kinds of KV live and
die separately while one slot list describes a sequence.

Allocation takes a full page and an SWA page together and maps them slot for slot, so a
token's two slots are at the same offset in their pages and every free is in whole pages.
"""

from __future__ import annotations

import torch

from .allocator import SlotAllocator

__all__ = ["HybridAllocator"]


class HybridAllocator(SlotAllocator):
    """A :class:`SlotAllocator` of full slots that also hands out the SWA slot of each."""

    def __init__(self, capacity: int, swa_capacity: int, page_size: int = 1, window: int = 0,
                 device: str | torch.device = "cpu") -> None:
        #: The sliding window (tokens) the SWA slots serve; a request's own tokens older than
        #: it give their SWA slots back as it goes.
        self.window = window
        self.swa = SlotAllocator(swa_capacity, page_size, device)
        super().__init__(capacity, page_size, device)

    def reset(self) -> None:
        super().reset()
        self.swa.reset()
        #: full slot -> SWA slot, -1 when it has none; the pad slot maps to the SWA pad slot.
        self.swa_map = torch.full((self.capacity + 1,), -1, dtype=torch.int64)
        self.swa_map[self.capacity] = self.swa.capacity

    @property
    def swa_available(self) -> int:
        return self.swa.available

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Full slots, each with an SWA slot; None (taking neither) if either pool is short."""
        if self.swa.pages_for(num_tokens) * self.page_size > self.swa.available:
            if num_tokens < 0:
                raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
            return None
        full = super().alloc(num_tokens)
        if full is None:
            return None
        self.swa_map[full] = self.swa.alloc(num_tokens)
        return full

    def free(self, indices: torch.Tensor) -> None:
        """Free full slots and whatever SWA slots they still have."""
        self.free_swa(indices)
        super().free(indices)

    def free_swa(self, indices: torch.Tensor) -> None:
        """Give back the SWA slots of ``indices`` (whole pages of full slots); the full slots
        stay. Slots that have none already are skipped."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).reshape(-1).cpu()
        mapped = self.swa_map[indices]
        live = mapped >= 0
        if bool(live.any()):
            self.swa.free(mapped[live])
            self.swa_map[indices[live]] = -1

    def has_swa(self, indices: torch.Tensor) -> torch.Tensor:
        """Per full slot: whether it still has its SWA slot."""
        return self.swa_map[indices] >= 0

    def move_swa(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Hand the SWA slots of ``src`` to ``dst`` (which have none): a request's freshly
        computed window KV revives a tombstone of the tree, whose full slots hold the same
        tokens' full KV."""
        if bool((self.swa_map[dst] >= 0).any()):
            raise RuntimeError("move_swa onto full slots that still have SWA slots")
        self.swa_map[dst] = self.swa_map[src]
        self.swa_map[src] = -1


class HybridKVPool:
    """The KV tensors of a hybrid model: the full-attention layers' in a pool indexed by full
    slots, the sliding-window layers' in a smaller pool indexed by ``swa_map[full slot]``;
    ``layer(i)`` says where layer ``i`` lives: ``(pool, index within it, window)``."""

    def __init__(self, layer_windows: list, capacity: int, swa_capacity: int, num_kv_heads: int,
                 head_dim: int, swa_map: torch.Tensor, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        from .kv_pool import KVPool

        n_swa = sum(1 for w in layer_windows if w)
        if not n_swa or n_swa == len(layer_windows):
            raise ValueError("a hybrid KV pool needs both full-attention and sliding-window layers")
        self.full = KVPool(len(layer_windows) - n_swa, capacity, num_kv_heads, head_dim, dtype, device)
        self.swa = KVPool(n_swa, swa_capacity, num_kv_heads, head_dim, dtype, device)
        self.swa_map = swa_map
        self._where = []
        counts = [0, 0]
        for w in layer_windows:
            kind = 1 if w else 0
            self._where.append((self.swa if kind else self.full, counts[kind], w))
            counts[kind] += 1
        self.num_layers = len(layer_windows)
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = self.full.dtype
        self.kv_dtype = self.full.kv_dtype
        self.quantized = self.full.quantized
        self.device = self.full.device

    def layer(self, i: int) -> tuple:
        return self._where[i]

    @property
    def pad_slot(self) -> int:
        return self.full.pad_slot

    def nbytes(self) -> int:
        return self.full.nbytes() + self.swa.nbytes()

    def check_scales(self, slots: torch.Tensor) -> None:
        """:meth:`KVPool.check_scales` in both pools: a sliding-window slot through the full
        slot it serves (a full slot whose window KV was given back maps to none)."""
        self.full.check_scales(slots)
        swa = self.swa_map[slots]
        self.swa.check_scales(swa[swa >= 0])

    @property
    def bytes_per_token(self) -> int:
        """Bytes of a token whose KV both kinds hold (its full-attention and window KV)."""
        return self.full.bytes_per_token + self.swa.bytes_per_token
