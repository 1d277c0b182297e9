"""The typed operands of the kernels' Python face: packed weights, and what the one-call
layer entries (:meth:`~radixserve.kernels.library.Kernels.llama_layers`, ``gemma3_layers``) take.

A layer entry takes a handful of these (weights, buffers, places, geometry) instead of the
thirty-odd tensors and scalars of its C++ operator: the fields name what each list holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class PackedWeight(NamedTuple):
    """A linear weight packed for :meth:`Kernels.packed_linear`: ``data`` holds ``[N, K]`` in
    the panel layout of csrc/gemm.cpp (float32 chains over float32 rows), or, with ``dot``,
    of csrc/gemm_dot.cpp (bfloat16 dot products: the rows rounded to bfloat16). A uint8
    ``data`` is a quantized weight (csrc/quant.h, :mod:`radixserve.kernels.quant_weights`): its
    blocks expand to the bfloat16 weights of the dense model, computed with the same
    arithmetic (``dot``: the dot products; else the float32 chains)."""

    data: torch.Tensor
    n: int
    k: int
    dot: bool = False

    @property
    def quantized(self) -> bool:
        return self.data.dtype == torch.uint8


def _float32_rows(rows: int, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """One uninitialised float32 ``[rows, width]`` buffer per width."""
    return [torch.empty((rows, n), dtype=torch.float32) for n in widths]


@dataclass(frozen=True)
class LlamaLayerWeights:
    """Per-layer weights of :meth:`Kernels.llama_layers`, one list entry per layer: norm
    weights (float32), the packed linears' ``data`` and the qkv bias (float32 or None).
    ``norm_post`` is HF's ``post_attention_layernorm`` (Llama: the MLP's input norm).
    ``dot``: every linear is packed for bfloat16 dot products (else for float32 chains)."""

    norm_in: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    norm_post: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    dot: bool


class LayerBuffers(NamedTuple):
    """The float32 rows :meth:`Kernels.llama_layers` works in, reused by every layer: x
    ``[T, hidden]``, qkv ``[T, (H + 2 KV) D]``, attn ``[T, H D]``, d and delta ``[T, hidden]``,
    gu ``[T, 2 I]``, act ``[T, I]``."""

    x: torch.Tensor
    qkv: torch.Tensor
    attn: torch.Tensor
    d: torch.Tensor
    delta: torch.Tensor
    gu: torch.Tensor
    act: torch.Tensor

    @classmethod
    def empty(cls, rows: int, hidden: int, qkv: int, attn: int, inter: int) -> "LayerBuffers":
        return cls(*_float32_rows(rows, (hidden, qkv, attn, hidden, hidden, 2 * inter, inter)))


@dataclass(frozen=True)
class Gemma3LayerWeights(LlamaLayerWeights):
    """Per-layer weights of :meth:`Kernels.gemma3_layers` (norms stored as ``1 + w``): the
    Llama ones, ``norm_post`` normalising the attention output, plus Gemma 3's own."""

    qk_norm: list[torch.Tensor]
    norm_pre_ff: list[torch.Tensor]
    norm_post_ff: list[torch.Tensor]


class Gemma3LayerBuffers(NamedTuple):
    """The float32 rows :meth:`Kernels.gemma3_layers` works in: x, d and dn ``[T, hidden]``,
    qkv and qk ``[T, (H + 2 KV) D]``, attn ``[T, H D]``, gu ``[T, 2 I]``, act ``[T, I]``."""

    x: torch.Tensor
    qkv: torch.Tensor
    qk: torch.Tensor
    attn: torch.Tensor
    d: torch.Tensor
    dn: torch.Tensor
    gu: torch.Tensor
    act: torch.Tensor

    @classmethod
    def empty(cls, rows: int, hidden: int, qkv: int, attn: int, inter: int) -> "Gemma3LayerBuffers":
        return cls(*_float32_rows(rows, (hidden, qkv, qkv, attn, hidden, hidden, 2 * inter, inter)))


class LayerPlaces(NamedTuple):
    """Where each layer's attention reads and writes, one entry per layer: its pool's K and
    V views and that pool's slot metadata, its window (0 = full), RoPE table, attention
    implementation and KV dtype name."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    out_slots: list[torch.Tensor]
    slots: list[torch.Tensor]
    seq_info: list[torch.Tensor]
    windows: list[int]
    cos: list[torch.Tensor]
    sin: list[torch.Tensor]
    impl: list[int]
    kv_dtype: list[str | None]


class PoolPlaces(NamedTuple):
    """Where every layer of a one-pool model (:meth:`Kernels.llama_layers`) reads and writes:
    the pool's K and V view per layer, the batch's slot metadata (shared by every layer), the
    RoPE table, the attention implementation and the KV dtype name (None: a float pool)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    out_slots: torch.Tensor
    slots: torch.Tensor
    seq_info: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    impl: int
    kv_dtype: str | None


class LayerGeometry(NamedTuple):
    """The shape and constants every layer of a model shares: head counts and size, the
    RMSNorm epsilon and the attention scale (built once per model)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
