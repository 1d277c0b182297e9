"""The attention backend interface: how new tokens' K/V reach the pool and how queries read it back.

The model computes q/k/v and hands them to a backend; the backend owns everything that
depends on the KV layout (slot indices, padding, masks, kernels). That split is what lets a
FlashInfer or Triton paged kernel replace the torch path later without touching the model.

Protocol, per forward pass:

* ``metadata = backend.prepare(batch, kv_pool)`` once — every index / mask that depends only
  on the batch (not on the layer) is built here, so the per-layer work is pure tensor math.
* ``out = backend.forward(q, k_new, v_new, layer_id, kv_pool, metadata, window=W, scale=s)``
  per layer — writes the new K/V into their slots and returns the attention output.
  ``window`` (default 0: full causal attention) is a sliding window: the query at position p
  attends to the keys at positions ``p - W + 1 .. p`` only (the last W, its own included,
  as Hugging Face's sliding-window mask ``kv > q - W``), and the backend never reads the
  slot (K/V) of a key before the window of the batch's first new token of a sequence — a
  sliding-window layer's cache may have freed those slots. ``scale`` (default
  ``head_dim ** -0.5``) multiplies q.k.
* ``backend.layer_kernels(dtype)``: the fused row-wise ops (RMSNorm + residual, RoPE,
  SiLU·mul) the model should use with this backend, or ``None`` for the eager torch ops.
  The backend name is the one switch between kernels and the eager reference.

Shapes: ``q`` is ``[T, num_heads, head_dim]``, ``k_new``/``v_new`` are
``[T, num_kv_heads, head_dim]`` (T = new tokens of all sequences, concatenated; RoPE already
applied; any row stride, e.g. views into the fused qkv output); the output is
``[T, num_heads * head_dim]`` in float32 or in q's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.kernels.library import Kernels


class AttentionBackend(ABC):
    """Interface the model calls; one instance serves every layer of one model."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch, kv_pool: KVPool) -> Any:
        """Build the per-forward metadata (indices, masks) shared by all layers."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, layer_id: int, kv_pool: KVPool,
                metadata: Any, *, window: int = 0, scale: float | None = None) -> torch.Tensor:
        """Write ``k_new``/``v_new`` into the pool, attend, return ``[T, heads*head_dim]``.

        ``window`` > 0: sliding-window attention over the last ``window`` positions, reading
        no slot before them; ``scale``: the q.k scale (None: ``head_dim ** -0.5``)."""

    def layer_kernels(self, dtype: torch.dtype, device: torch.device) -> Kernels | None:
        """Fused row-wise ops for a model of this dtype / device, or None (eager torch ops)."""
        return None

    def layer_caches(self, kv_pool: KVPool, metadata: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's (K, V) pool views where a model may run the attention kernels itself
        (all layers in one C++ call), else None: the model then calls :meth:`forward`."""
        return None


def check_batch(batch: ForwardBatch) -> None:
    """ValueError for a batch whose per-sequence lists disagree, before any index is built
    from it (shared by every backend, so each rejects the same batches the same way)."""
    num_seqs = batch.num_seqs
    if len(batch.seq_slots) != num_seqs or len(batch.prefix_lens) != num_seqs:
        raise ValueError("ForwardBatch.seq_slots / prefix_lens must have one entry per sequence "
                         f"({num_seqs}), got {len(batch.seq_slots)} / {len(batch.prefix_lens)}")
    total = sum(batch.extend_lens)
    if total != batch.input_ids.numel():
        raise ValueError(f"ForwardBatch.extend_lens sum to {total} but input_ids has {batch.input_ids.numel()} tokens")

