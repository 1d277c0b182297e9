"""The L2 tier: KV of cached tokens in host memory, with its own slot allocator.

The attention pool (:class:`~radixserve.memory.kv_pool.KVPool`, L1) holds the running requests
*and* the cache; copying cached runs down to a larger pool in host memory lets L1 stay small
while the cache grows (:mod:`radixserve.cache.hicache` loads a run back before it is read).

The layout is the KV pool's, ``[layers, 2, slots, kv_heads, row]`` (a quantized pool's rows
carry their scales), so moving tokens between tiers is one gather (``index_select`` on the
slot dimension) and one scatter (``index_copy_``) for all layers at once, whatever the slots.
The pool is device-neutral: on a CPU device both tiers are RAM; on an accelerator,
``pin_memory=True`` makes the host tensor page-locked so that the copies can run
asynchronously (``non_blocking``) on a side stream. They are issued synchronously here; a
caller that overlaps them must keep both ends of a copy alive until it has synchronised (the
cache pins them).

Slots are allocated in whole pages (the tree's page size) by the same free list as L1
(:class:`~radixserve.memory.allocator.SlotAllocator`); the pool's memory is reserved but not
touched until written (``torch.empty``), so a large L2 costs nothing until it fills.
"""

from __future__ import annotations

import torch

from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.quant import parse_kv_dtype, row_elems, storage_dtype

__all__ = ["HostKVPool"]


def _as_index(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        idx = torch.as_tensor(idx, dtype=torch.int64)
    if idx.dtype != torch.int64:
        idx = idx.to(torch.int64)
    return idx if idx.device == device else idx.to(device)


class HostKVPool:
    """``capacity`` token slots of KV in host memory, shaped like a :class:`KVPool`'s."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.float32,
        page_size: int = 1,
        pin_memory: bool = False,
    ) -> None:
        """``dtype``: a torch float dtype or a KV kind name (``radixserve.memory.quant``)."""
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < page_size:
            raise ValueError(f"capacity must be an int >= page_size ({page_size}), got {capacity!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = parse_kv_dtype(dtype)
        self.dtype = storage_dtype(self.kv_dtype)
        self.row_dim = row_elems(self.kv_dtype, head_dim)
        self.page_size = page_size
        self.allocator = SlotAllocator(capacity, page_size)
        self.capacity = self.allocator.capacity
        self.device = torch.device("cpu")
        shape = (num_layers, 2, self.capacity, num_kv_heads, self.row_dim)
        self.kv = torch.empty(shape, dtype=self.dtype, pin_memory=pin_memory)

    @classmethod
    def like(cls, pool: KVPool, capacity: int, page_size: int = 1, pin_memory: bool | None = None) -> "HostKVPool":
        """A host pool whose tokens have ``pool``'s shape and dtype (pinned when ``pool``
        lives on an accelerator, unless told otherwise)."""
        if pin_memory is None:
            pin_memory = pool.device.type != "cpu"
        return cls(pool.num_layers, capacity, pool.num_kv_heads, pool.head_dim, pool.kv_dtype,
                   page_size, pin_memory)

    # ------------------------------------------------------------------ slots
    @property
    def available(self) -> int:
        return self.allocator.available

    @property
    def used(self) -> int:
        return self.capacity - self.allocator.available

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Host slots for ``num_tokens`` tokens (whole pages), or None if the pool is full."""
        return self.allocator.alloc(num_tokens)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    bytes_per_token = KVPool.bytes_per_token
    nbytes = KVPool.nbytes

    def check_compatible(self, pool: KVPool) -> None:
        """Raise ValueError unless a token of ``pool`` has this pool's shape and dtype."""
        mine = (self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)
        theirs = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.kv_dtype)
        if mine != theirs:
            raise ValueError(f"host_pool holds (layers, kv_heads, head_dim, dtype) {mine}, "
                             f"the KV pool {theirs}")

    # ------------------------------------------------------------------ transfers
    def backup_from(self, pool: KVPool, device_idx, host_idx) -> int:
        """Copy tokens ``device_idx`` of ``pool`` (L1) into ``host_idx`` (L2); return bytes moved."""
        return self._copy(pool.kv, device_idx, "device_idx", self.kv, host_idx, "host_idx", False)

    def load_to(self, pool: KVPool, host_idx, device_idx, non_blocking: bool = False) -> int:
        """Copy tokens ``host_idx`` (L2) into slots ``device_idx`` of ``pool`` (L1); return bytes."""
        return self._copy(self.kv, host_idx, "host_idx", pool.kv, device_idx, "device_idx", non_blocking)

    def _copy(self, src: torch.Tensor, src_idx, src_name: str, dst: torch.Tensor, dst_idx, dst_name: str,
              non_blocking: bool) -> int:
        """Tokens ``src_idx`` of ``src`` into ``dst_idx`` of ``dst`` (one gather, one scatter)."""
        s = _as_index(src_idx, src.device)
        d = _as_index(dst_idx, dst.device)
        if s.numel() != d.numel():
            raise ValueError(f"{src_name} has {s.numel()} slots, {dst_name} {d.numel()}")
        if not s.numel():
            return 0
        dst.index_copy_(2, d, src.index_select(2, s).to(dst.device, non_blocking=non_blocking))
        return int(s.numel()) * self.bytes_per_token

    def read(self, host_idx) -> torch.Tensor:
        """A fresh ``[layers, 2, n, kv_heads, row]`` copy of tokens ``host_idx``."""
        return self.kv.index_select(2, _as_index(host_idx, self.device))

    def write(self, host_idx, data: torch.Tensor) -> int:
        """Store ``data`` (``[layers, 2, n, kv_heads, row]``) into tokens ``host_idx``."""
        h = _as_index(host_idx, self.device)
        want = (self.num_layers, 2, int(h.numel()), self.num_kv_heads, self.row_dim)
        if tuple(data.shape) != want:
            raise ValueError(f"data must have shape {want}, got {tuple(data.shape)}")
        if h.numel():
            self.kv.index_copy_(2, h, data.to(self.device, self.dtype))
        return int(h.numel()) * self.bytes_per_token

    def __repr__(self) -> str:
        return (f"HostKVPool(capacity={self.capacity}, used={self.used}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.kv_dtype})")
