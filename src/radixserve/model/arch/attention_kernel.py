"""The default attention backend (``"torch"``): the CPU paged-attention kernels, eager elsewhere.

Kept apart from the eager backend it extends so the kernel path (its metadata, the cached
pool views, the implementation choice per dtype) reads on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention_base import check_batch
from radixserve.model.arch.attention_eager import EagerTorchAttentionBackend, TorchAttentionMetadata
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.kernels.builder import KernelBuildError
from radixserve.kernels.library import IMPL_AUTO, Kernels, load_kernels, try_load_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)  # uint8: a quantized pool


@dataclass
class KernelAttentionMetadata:
    """What the paged attention kernel needs, built once per forward pass."""

    out_slots: torch.Tensor  # [T] int64 slots that receive the new K/V
    slots: torch.Tensor  # every sequence's slots (prefix + new), concatenated, int64
    # [B, 4] int64 per sequence: first row in T, new tokens, first entry in slots, KV length.
    seq_info: torch.Tensor
    num_tokens: int
    num_decode: int  # sequences with one new token (informational)
    out: torch.Tensor | None = None  # [T, H * D] output, allocated by the first layer, reused


class TorchAttentionBackend(EagerTorchAttentionBackend):
    """The default backend: the CPU kernels of ``kernels/csrc`` where they apply, else eager.

    ``kernels``: None (default) uses them when they build (a failed build is logged once with
    the compiler output, then this backend runs the eager path); True requires them
    (raises ``KernelBuildError``); False never loads them (same as "torch-eager").
    ``cpu_isa``: the instruction-set cap, handed to the kernels (``Kernels.capped``), which pick
    the fastest attention implementation the CPU has under it, per pool dtype and head size.
    ``attention_impl`` forces a kernel implementation (``radixserve.kernels.library.IMPL_*``;
    0 = the fastest under the cap) — for benchmarks and tests.

    Which path a forward takes depends only on the device and dtypes (model, pool), never on
    the batch: mixing paths within one model would break cache-on == cache-off exactness.
    """

    name = "torch"

    def __init__(self, device: str | torch.device = "cpu", kernels: bool | None = None,
                 attention_impl: int = IMPL_AUTO, cpu_isa: str = "auto"):
        super().__init__(device=device)
        self._kernels: Kernels | None = None
        self.attention_impl = attention_impl
        self._impls: dict[tuple[torch.dtype, int], int] = {}
        # Per-layer K and V views of each pool in use (a hybrid model alternates two): built
        # once, not per layer per forward (a decode step's Python overhead is part of its latency).
        self._views: dict[int, tuple[torch.Tensor, tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        if kernels is not False and self.device.type == "cpu":
            loaded = load_kernels() if kernels else try_load_kernels()
            self._kernels = loaded.capped(cpu_isa) if loaded is not None else None
        elif kernels:
            raise KernelBuildError(f"the CPU kernels do not serve device {self.device}")

    @property
    def kernels(self) -> Kernels | None:
        return self._kernels

    @property
    def uses_kernels(self) -> bool:
        """Whether the kernels are loaded (they then serve float32 / bfloat16 pools)."""
        return self._kernels is not None

    def impl_for(self, kv_dtype: torch.dtype, head_dim: int) -> int:
        """The attention implementation this backend runs for a pool of ``kv_dtype``."""
        if self.attention_impl != IMPL_AUTO or self._kernels is None:
            return self.attention_impl
        key = (kv_dtype, head_dim)
        impl = self._impls.get(key)
        if impl is None:
            impl = self._impls[key] = self._kernels.pick_attention_impl(kv_dtype, head_dim)
        return impl

    def layer_kernels(self, dtype: torch.dtype, device: torch.device) -> Kernels | None:
        if self._kernels is None or dtype not in _KERNEL_DTYPES or device.type != "cpu":
            return None
        return self._kernels

    def _kernel_path(self, kv_pool: KVPool) -> bool:
        return (self._kernels is not None and kv_pool.dtype in _KERNEL_POOL_DTYPES
                and kv_pool.kv.device.type == "cpu")

    def prepare(self, batch: ForwardBatch, kv_pool: KVPool) -> KernelAttentionMetadata | TorchAttentionMetadata:
        if not self._kernel_path(kv_pool):
            return super().prepare(batch, kv_pool)
        check_batch(batch)
        ext, pre = batch.extend_lens, batch.prefix_lens
        info: list[list[int]] = []
        q_start = kv_start = 0
        for p, e in zip(pre, ext):
            info.append([q_start, e, kv_start, p + e])
            q_start += e
            kv_start += p + e
        slots = batch.seq_slots[0] if len(batch.seq_slots) == 1 else torch.cat(batch.seq_slots)
        return KernelAttentionMetadata(
            out_slots=_as_index(batch.out_slots),
            slots=_as_index(slots),
            seq_info=torch.tensor(info, dtype=torch.int64),
            num_tokens=q_start,
            num_decode=sum(1 for e in ext if e == 1),
        )

    def layer_caches(self, kv_pool: KVPool, metadata: object) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's (K, V) pool views, for a caller that runs the layers' kernels itself
        (``Kernels.llama_layers``); None where this forward is not on the kernel path."""
        if not isinstance(metadata, KernelAttentionMetadata):
            return None
        return self._pool_views(kv_pool)

    def _pool_views(self, kv_pool: KVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        kv = kv_pool.kv
        hit = self._views.get(id(kv))
        if hit is None or hit[0] is not kv:
            if len(self._views) >= 4:  # pools replaced: forget the old ones
                self._views.clear()
            hit = self._views[id(kv)] = (kv, ([layer[0] for layer in kv], [layer[1] for layer in kv]))
        return hit[1]

    def forward(self, q, k_new, v_new, layer_id, kv_pool, metadata, *, window=0, scale=None):  # type: ignore[override]
        if not isinstance(metadata, KernelAttentionMetadata):
            return super().forward(q, k_new, v_new, layer_id, kv_pool, metadata, window=window, scale=scale)
        kern = self._kernels
        assert kern is not None
        k_caches, v_caches = self._pool_views(kv_pool)
        k_cache, v_cache = k_caches[layer_id], v_caches[layer_id]
        if kv_pool.quantized:
            kern.store_kv_quant(k_new, v_new, k_cache, v_cache, metadata.out_slots, kv_pool.kv_dtype)
        else:
            kern.store_kv(k_new, v_new, k_cache, v_cache, metadata.out_slots)
        t, h, d = q.shape
        if q.dtype not in _KERNEL_DTYPES:
            q = q.float()
        out = metadata.out
        # One output buffer per forward: each layer's o_proj has read it before the next
        # layer's attention writes it.
        if out is None or out.dtype != q.dtype or out.shape != (t, h * d):
            out = metadata.out = torch.empty((t, h * d), dtype=q.dtype)
        return kern.attention(q, k_cache, v_cache, metadata.slots, metadata.seq_info, out,
                              d**-0.5 if scale is None else scale, self.impl_for(k_cache.dtype, d),
                              window, kv_pool.kv_dtype)


def _as_index(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU int64 tensor (what the kernels index with)."""
    if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
        t = t.to(device="cpu", dtype=torch.int64).contiguous()
    return t
