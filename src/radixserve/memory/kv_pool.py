"""The KV tensors that the prefix cache and the running requests share.

One tensor ``[layers, 2, slots, kv_heads, head_dim]``: K at index 0, V at index 1. A slot is
a token's K/V in every layer. The pool knows nothing of requests or of the tree; the
scheduler decides which slots belong to whom, the model reads and writes them by index.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # One extra slot at the end: a scratch slot that padded positions may write to and
        # read from, so batched kernels never need a branch for padding.
        self.kv = torch.zeros(
            (num_layers, 2, capacity + 1, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )

    @property
    def pad_slot(self) -> int:
        return self.capacity

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[n, kv_heads, head_dim]`` of n new tokens into their slots."""
        self.kv[layer, 0].index_copy_(0, slots, k.to(self.dtype))
        self.kv[layer, 1].index_copy_(0, slots, v.to(self.dtype))

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
