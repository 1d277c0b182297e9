"""The KV tensors that the prefix cache and the running requests share.

One tensor ``[layers, 2, slots, kv_heads, row]``: K at index 0, V at index 1. A slot is a
token's K/V in every layer. ``row`` is ``head_dim`` for float32 / bfloat16 pools; a quantized
pool (int8, fp8 e4m3) stores raw bytes, each head's row being its codes and then its float32
scale (:mod:`radixserve.memory.quant`), so whatever moves a slot moves its scales. The pool
knows nothing of requests or of the tree; the scheduler decides which slots belong to whom,
the model reads and writes them by index.
"""

from __future__ import annotations

import math
import mmap

import torch

from radixserve.memory.quant import dequantize, is_quantized, parse_kv_dtype, quantize, row_elems, storage_dtype

_HUGE_PAGE = 2 << 20
_MIN_HUGE_BYTES = 8 << 20  # below this, a plain allocation is just as good


class KVPool:
    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
    ):
        """``dtype``: a torch float dtype, or a KV kind name (``radixserve.memory.quant.KV_DTYPES``)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = parse_kv_dtype(dtype)
        self.quantized = is_quantized(self.kv_dtype)
        self.dtype = storage_dtype(self.kv_dtype)  # the tensor's element type
        self.row_dim = row_elems(self.kv_dtype, head_dim)
        self.device = torch.device(device)
        # One extra slot at the end: a scratch slot that padded positions may write to and
        # read from, so batched kernels never need a branch for padding.
        shape = (num_layers, 2, capacity + 1, num_kv_heads, self.row_dim)
        self.kv = zeros_on_huge_pages(shape, self.dtype, self.device)

    @property
    def pad_slot(self) -> int:
        return self.capacity

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., head_dim]`` as this pool stores them (rounded or quantized)."""
        return quantize(x, self.kv_dtype) if self.quantized else x.to(self.dtype)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., row_dim]`` as float32 ``[..., head_dim]`` (what attention reads)."""
        return dequantize(rows, self.kv_dtype) if self.quantized else rows.float()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[n, kv_heads, head_dim]`` of n new tokens into their slots."""
        self.kv[layer, 0].index_copy_(0, slots, self.encode(k))
        self.kv[layer, 1].index_copy_(0, slots, self.encode(v))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` in one layer as float32 ``[n, kv_heads, head_dim]``."""
        return (self.decode(self.kv[layer, 0].index_select(0, slots)),
                self.decode(self.kv[layer, 1].index_select(0, slots)))

    def check_scales(self, slots: torch.Tensor) -> None:
        """AssertionError unless every scale of ``slots`` (all layers, K and V) is finite and
        positive: what a quantized row written by :meth:`encode` always has, so anything
        else is a slot whose bytes were damaged or never written. A float pool has none."""
        if not self.quantized or not slots.numel():
            return
        rows = self.kv.index_select(2, slots.to(self.kv.device))
        scales = rows[..., self.head_dim :].contiguous().view(torch.float32)
        bad = ~(torch.isfinite(scales) & (scales > 0))
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise AssertionError(f"KV pool: slot {int(slots[where[2]])} (layer {where[0]}, "
                                 f"{'KV'[where[1]]}, head {where[3]}) has scale {float(scales[tuple(where)])}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes in this pool (scales included)."""
        return self.num_layers * 2 * self.num_kv_heads * self.row_dim * self.kv.element_size()

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed CPU tensor in memory the kernel is asked to back with 2 MB pages.

    Decode reads every context row of every request at every step, from slots spread over a
    pool of hundreds of MB: with 4 KB pages nearly every row is a TLB miss. Transparent huge
    pages are often enabled only on request (``/sys/kernel/mm/transparent_hugepage/enabled``
    = ``madvise``), so the pool is an anonymous mmap, 2 MB aligned, with ``MADV_HUGEPAGE``
    (fresh anonymous memory is already zero); elsewhere (other devices, small pools, no
    ``madvise``) a plain ``torch.zeros``."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if (device.type != "cpu" or nbytes < _MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE")
            or not hasattr(mmap, "MAP_PRIVATE")):
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        # Private: a shared anonymous mapping is shmem, which anonymous THP does not cover.
        buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps ``buf`` alive
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)
