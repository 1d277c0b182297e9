"""A Llama-family model's decoder layers on the kernels' path: the fused row-wise ops between
the packed linears, or every layer in one C++ call (:meth:`Kernels.llama_layers`).

:class:`KernelLayers` is built once per packing of the model (its per-layer weight lists are
looked up once, not through ``nn.Module`` attribute access in every forward) and run once per
forward. Its two paths make the same kernel calls in the same order, so they give the same bits.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from radixserve.kernels.library import Kernels
from radixserve.kernels.linear import Linears
from radixserve.kernels.operands import LayerBuffers, LayerGeometry, LlamaLayerWeights, PackedWeight, PoolPlaces
from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.model_config import ModelConfig


class KernelLayers:
    """The decoder layers of one packing, run with the fused row-wise kernels.

    Per layer: x = norm(h) -> qkv = x Wqkv -> RoPE in place on qkv -> attention (writes
    K/V to the pool, output in the serving dtype) -> h += o Wo, x = norm(h) (one kernel)
    -> gu = x Wgu -> a = silu(g) * u -> h += a Wdown (fused into the next layer's norm).
    """

    def __init__(self, config: ModelConfig, layers: nn.ModuleList, linears: Linears):
        self.config = config
        self.linears = linears
        self.geometry = LayerGeometry(config.num_heads, config.num_kv_heads, config.head_dim,
                                      config.rms_norm_eps, config.head_dim ** -0.5)
        #: Per layer (input_norm, qkv, qkv_bias, o, post_attn_norm, gate_up, down).
        self.per_layer = [(l.input_norm, l.qkv_weight, l.qkv_bias, l.o_weight, l.post_attn_norm,
                           l.gate_up_weight, l.down_weight) for l in layers]
        #: The same weights as :meth:`Kernels.llama_layers` takes them (None: not all packed
        #: for our GEMM, so no one-call path).
        self.one_call: LlamaLayerWeights | None = None
        if linears.ours and self.per_layer and isinstance(self.per_layer[0][1], PackedWeight):
            ws = self.per_layer
            self.one_call = LlamaLayerWeights(
                [w[0] for w in ws], [w[1].data for w in ws], [w[2] for w in ws], [w[3].data for w in ws],
                [w[4] for w in ws], [w[5].data for w in ws], [w[6].data for w in ws], ws[0][1].dot)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
            kv_pool: KVPool, attn: AttentionBackend, meta: object, kern: Kernels,
            reduce: Callable[[torch.Tensor], torch.Tensor] | None, one_call: bool,
            tail: torch.Tensor | None = None, fused_gate: bool = True) -> torch.Tensor:
        """Every layer over the float32 residual ``hidden`` (updated in place) in one C++ call
        where ``one_call`` allows it and nothing (a tensor-parallel reduce, a backend off the
        kernels' attention) stands between the layers. Returns the residual rows: all of them,
        or with ``tail`` (increasing row indices) those rows only, the last layer having run
        past its attention on them alone. ``fused_gate``: gate_up and SiLU·mul in one pass where
        the weights allow it (:meth:`Kernels.gated_linear`; the same bits as two)."""
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        caches = attn.layer_caches(kv_pool, meta) if one_call and reduce is None and self.one_call else None
        if caches is None:
            return self._loop(hidden, positions, rope, kv_pool, attn, meta, kern, reduce, tail, fused_gate)
        cfg, g = self.config, self.geometry
        qs, kvs = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        buffers = LayerBuffers.empty(hidden.shape[0], cfg.hidden_size, qs + 2 * kvs, qs, cfg.intermediate_size)
        places = PoolPlaces(caches[0], caches[1], meta.out_slots, meta.slots, meta.seq_info, *rope,
                            attn.impl_for(caches[0][0].dtype, g.head_dim), kv_pool.kv_dtype)
        kern.llama_layers(hidden, buffers, self.one_call, places, positions, g, tail, fused_gate=fused_gate)
        return hidden if tail is None else hidden[: tail.shape[0]]

    def _loop(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              kv_pool: KVPool, attn: AttentionBackend, meta: object, kern: Kernels,
              reduce: Callable[[torch.Tensor], torch.Tensor] | None,
              tail: torch.Tensor | None = None, fused_gate: bool = True) -> torch.Tensor:
        """The layers from Python, one kernel call at a time (see the class docstring and
        :meth:`run` for ``tail``)."""
        t, g, linear = hidden.shape[0], self.geometry, self.linears
        nh, nkv, hd, eps = g.num_heads, g.num_kv_heads, g.head_dim, g.eps
        qs, kvs, dtype = nh * hd, nkv * hd, linear.act_dtype
        # Buffers reused by every layer (each is consumed by the next matmul before it is
        # rewritten): a decode step is short enough for allocations to show.
        x = torch.empty((t, self.config.hidden_size), dtype=dtype)
        act = torch.empty((t, self.config.intermediate_size), dtype=dtype)
        delta: torch.Tensor | None = None  # the previous layer's down_proj output
        for layer_id, (w_in, w_qkv, b_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.per_layer):
            if delta is None:
                kern.rms_norm(hidden, w_in, eps, dtype, out=x)
            else:
                kern.add_rms_norm(hidden, delta, w_in, eps, dtype, out=x)
            qkv = linear(x, w_qkv, b_qkv)  # [T, (H + 2 KV) * D]
            kern.rope_(qkv, positions, *rope, nh + nkv, hd)
            q = qkv[:, :qs].view(t, nh, hd)
            k = qkv[:, qs : qs + kvs].view(t, nkv, hd)
            v = qkv[:, qs + kvs :].view(t, nkv, hd)
            o = attn.forward(q, k, v, layer_id, kv_pool, meta)  # [T, H * D]
            if tail is not None and layer_id + 1 == len(self.per_layer):
                # Past the last attention only the tail rows matter (see run).
                if tail.shape[0] == 0:
                    return hidden[:0]
                hidden, o, x, act = hidden.index_select(0, tail), o.index_select(0, tail), x[: tail.shape[0]], \
                    act[: tail.shape[0]]
            d = linear(o if o.dtype == dtype else o.to(dtype), w_o)
            kern.add_rms_norm(hidden, reduce(d) if reduce is not None else d, w_post, eps, dtype, out=x)
            if linear.ours and isinstance(w_gu, PackedWeight) and act.dtype == torch.float32:
                linear.kernels.gated_linear(x, w_gu, "silu", out=act, fuse=fused_gate)
            else:
                kern.silu_mul(linear(x, w_gu), out=act)
            delta = linear(act, w_down)
            if reduce is not None:
                delta = reduce(delta)
        if delta is not None:
            hidden.add_(delta)
        return hidden
