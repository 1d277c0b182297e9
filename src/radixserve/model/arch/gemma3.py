"""Gemma 3 (text): a decoder with hybrid attention over the same slot-indexed KV pool.

The model is :class:`~radixserve.model.arch.llama.LlamaForCausalLM` with these differences (all
checked against transformers' ``Gemma3ForCausalLM``):

* Hybrid attention: ``ModelConfig.layer_types`` marks each layer "sliding" or "full" (five
  local layers to one global in the released models). A sliding layer's query at position
  p attends to the keys ``p - W + 1 .. p`` (``W = sliding_window``), and the attention
  backend reads no slot before that window (``AttentionBackend.forward(window=W)``), so
  the cache may drop those slots later. Full layers attend causally to everything.
* RoPE: base ``rope_theta`` (1e6) with ``rope_scaling`` in the full layers, base
  ``rope_local_theta`` (1e4) unscaled in the sliding ones: two cos/sin tables.
* q.k is scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
* RMSNorm multiplies by ``1 + w`` (in float32); the ``1 + w`` is formed once at load time,
  so every norm is the Llama one. q and k are RMS-normalised per head (``q_norm``,
  ``k_norm`` over head_dim) before RoPE.
* Sandwich norms: the attention output and the MLP output are each normalised
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) before their residual add;
  the MLP input has its own norm (``pre_feedforward_layernorm``).
* GeGLU MLP: ``gelu_tanh(gate) * up`` (``hidden_act = "gelu_pytorch_tanh"``).
* The embeddings are scaled by ``sqrt(hidden_size)``, the scale rounded to the embedding
  dtype first (as transformers does: 25.3 becomes 25.25 in bfloat16); tied lm_head.
* ``final_logit_softcapping`` (None in Gemma 3), when set: ``cap * tanh(logits / cap)``.
  Attention logit softcapping (Gemma 2) is not implemented: the loaders refuse it.

Numerics follow llama.py: float32 residual stream, norms, RoPE and attention; matmuls in
the linears' dtype. With an attention backend that provides kernels, the RMSNorms (with
their residual adds), the per-head q/k norms with RoPE (one pass that also widens v) and
the GeGLU run as the fused row-wise kernels.

Tensor parallelism is not implemented for Gemma 3 (``parallel.sharding`` refuses it).
"""

from __future__ import annotations

import dataclasses

import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.memory.swa_pool import HybridKVPool
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.loaders.hf_weights import HFWeights
from radixserve.kernels.library import Kernels
from radixserve.kernels.operands import Gemma3LayerBuffers, Gemma3LayerWeights, LayerGeometry, LayerPlaces
from radixserve.model.arch.gemma3_row_ops import EagerGemma3Ops, KernelGemma3Ops
from radixserve.model.arch.layers import EmptyParams, RotaryTable
from radixserve.model.arch.llama import DecoderLayer, LlamaForCausalLM


class Gemma3DecoderLayer(DecoderLayer):
    """A decoder layer's weights plus Gemma 3's extra norms (each stored as ``1 + w``).

    ``post_attn_norm`` holds HF's ``post_attention_layernorm``, which in Gemma 3 normalises
    the attention output (in Llama it is the MLP's input norm: here ``pre_ff_norm``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(config, dtype, device)
        h, d = config.hidden_size, config.head_dim

        norm = EmptyParams(torch.float32, device)
        self.q_norm = norm(d)
        self.k_norm = norm(d)
        self.pre_ff_norm = norm(h)
        self.post_ff_norm = norm(h)
        # [num_heads + num_kv_heads, head_dim]: q_norm for the q heads, k_norm for the k heads
        # of the fused projection (one norm call over both), built at load time.
        self.qk_norm = torch.empty(0)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 causal LM (text) over a slot-indexed KV pool; see the module docstring."""

    layer_cls = Gemma3DecoderLayer
    ARCHS = ("gemma3",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__(config, dtype, device)
        local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
        self.rotary_local = RotaryTable(local, self.device, initial=min(4096, config.max_position_embeddings))
        # Per layer: its sliding window (0 = full attention).
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]
        # sqrt(hidden) rounded to float32, then to the embedding dtype, as transformers has it.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype=dtype, device=self.device)
        self.geometry = LayerGeometry(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                      config.attn_scale)
        # Built once per packing (the linears they were built for, then the objects).
        self._ops_key: tuple | None = None
        self._ops: EagerGemma3Ops | None = None
        self._g3_for: object = None
        self._g3: Gemma3LayerWeights | None = None

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.arch not in cls.ARCHS:
            raise ValueError(f"{cls.__name__} runs arch gemma3, not {config.arch!r}")

    # ------------------------------------------------------------------ loading
    def _load_weights(self, weights: HFWeights) -> None:
        super()._load_weights(weights)
        cfg = self.config
        h, d = cfg.hidden_size, cfg.head_dim
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            weights.put(layer.q_norm, weights.get(pre + "self_attn.q_norm.weight", (d,)))
            weights.put(layer.k_norm, weights.get(pre + "self_attn.k_norm.weight", (d,)))
            weights.put(layer.pre_ff_norm, weights.get(pre + "pre_feedforward_layernorm.weight", (h,)))
            weights.put(layer.post_ff_norm, weights.get(pre + "post_feedforward_layernorm.weight", (h,)))
        # Gemma's RMSNorm scales by (1 + w), in float32: formed once here (new tensors: the
        # loaded ones may be the caller's).
        for layer in self.layers:
            for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm"):
                p = getattr(layer, name)
                p.data = 1.0 + p.data
            layer.qk_norm = torch.cat((layer.q_norm.data.expand(cfg.num_heads, d),
                                       layer.k_norm.data.expand(cfg.num_kv_heads, d)))
        self.final_norm.data = 1.0 + self.final_norm.data

    # ------------------------------------------------------------------ forward
    def _rotary_tables(self) -> tuple[RotaryTable, ...]:
        return (self.rotary, self.rotary_local)

    def _prepare_attention(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend) -> object:
        """As the Llama model's; with a :class:`HybridKVPool` the sliding layers read and write
        the SWA pool, through the SWA slots of the batch's full slots: one metadata per pool,
        by the pool's ``id``."""
        if not isinstance(kv_pool, HybridKVPool):
            return super()._prepare_attention(batch, kv_pool, attn)
        m = kv_pool.swa_map
        swa_batch = dataclasses.replace(batch, out_slots=m[batch.out_slots],
                                        seq_slots=[m[s] for s in batch.seq_slots])
        return {id(kv_pool.full): attn.prepare(batch, kv_pool.full),
                id(kv_pool.swa): attn.prepare(swa_batch, kv_pool.swa)}

    def _run_layers(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend,
                    meta: object, kern: Kernels | None, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers; the float32 residual stream. Per layer:

        x = norm_in(h) -> qkv = x Wqkv -> q, k = per-head norms, RoPE (local or global
        table) -> attention (sliding window or full) -> h += norm_post_attn(o Wo) ->
        x = norm_pre_ff(h) -> gu = x Wgu -> h += norm_post_ff(gelu_tanh(g) * u Wdown).
        With kernels, each residual add runs fused into the next norm, or every layer runs
        in one C++ call (:meth:`Kernels.gemma3_layers`: the same kernels, the same bits).
        With ``tail`` on the kernels' path the last layer runs past its attention on those rows
        only, and only they are returned (see the Llama model's)."""
        ops = self._row_ops(kern)
        ops.start(batch)
        # Embeddings times sqrt(hidden) in the embedding dtype (transformers' rounding), then
        # the float32 residual stream (a fresh tensor, safe to update in place).
        hidden = self.embed_tokens(batch.input_ids).mul_(self.embed_scale).to(torch.float32)
        if isinstance(kv_pool, HybridKVPool):  # meta: per pool (see _prepare_attention)
            place = [(pool, j, meta[id(pool)]) for pool, j, _ in map(kv_pool.layer, range(len(self.layers)))]
        else:
            place = [(kv_pool, i, meta) for i in range(len(self.layers))]
        weights = self._one_call_weights() if isinstance(ops, KernelGemma3Ops) else None
        places = self._layer_places(place, attn, ops.tables) if weights is not None else None
        if kern is None:
            tail = None  # eager rows are not batch-invariant: every row, selected afterwards
        if places is None:
            return self._layer_loop(hidden, place, attn, ops, tail)
        cfg, qs, kvs = self.config, self._q_size, self._kv_size
        buffers = Gemma3LayerBuffers.empty(hidden.shape[0], cfg.hidden_size, qs + 2 * kvs, qs, cfg.intermediate_size)
        ops.kern.gemma3_layers(hidden, buffers, weights, places, ops.positions, self.geometry, tail,
                               fused_gate=self.fused_gate_up)
        return hidden if tail is None else hidden[: tail.shape[0]]

    def _layer_loop(self, hidden: torch.Tensor, place: list[tuple], attn: AttentionBackend,
                    ops: EagerGemma3Ops, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The layers from Python over the residual ``hidden`` (see :meth:`_run_layers`)."""
        nh, scale, reduce, linear, layers = self.config.num_heads, self.config.attn_scale, self.all_reduce, \
            self.linears, self.layers
        dtype = linear.act_dtype
        x_buf = torch.empty((hidden.shape[0], self.config.hidden_size), dtype=dtype)
        d_buf = torch.empty((hidden.shape[0], self.config.hidden_size), dtype=torch.float32)
        x = ops.norm(hidden, layers[0].input_norm, dtype, x_buf)
        for layer_id, layer in enumerate(layers):
            window = self.windows[layer_id]
            pool, pool_layer, pool_meta = place[layer_id]
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias)  # [T, (H + 2 KV) * D]
            qk, v = ops.qk_v(qkv, layer.qk_norm, window > 0)  # float32: per-head norms, RoPE
            o = attn.forward(qk[:, :nh], qk[:, nh:], v, pool_layer, pool, pool_meta, window=window, scale=scale)
            if tail is not None and layer_id + 1 == len(layers):
                if tail.shape[0] == 0:
                    return hidden[:0]
                r = tail.shape[0]
                hidden, o, x_buf, d_buf = hidden.index_select(0, tail), o.index_select(0, tail), x_buf[:r], d_buf[:r]
            d = linear(o if o.dtype == dtype else o.to(dtype), layer.o_weight)
            d = ops.norm(reduce(d) if reduce is not None else d, layer.post_attn_norm, torch.float32, d_buf)
            x = ops.add_norm(hidden, d, layer.pre_ff_norm, x_buf)
            d = linear(ops.gated(x, layer.gate_up_weight, linear, self.fused_gate_up), layer.down_weight)
            d = ops.norm(reduce(d) if reduce is not None else d, layer.post_ff_norm, torch.float32, d_buf)
            if layer_id + 1 < len(layers):
                x = ops.add_norm(hidden, d, layers[layer_id + 1].input_norm, x_buf)
            else:
                hidden.add_(d)
        return hidden

    def _row_ops(self, kern: Kernels | None) -> EagerGemma3Ops:
        """The row-wise ops for these kernels (None: eager) and the current packing, built once."""
        key = (kern, self.linears)
        if self._ops_key is None or any(a is not b for a, b in zip(self._ops_key, key)):
            dtype = self.linears.act_dtype
            tables = self._rotary_tables()
            self._ops = (EagerGemma3Ops(self.config, dtype, *tables) if kern is None
                         else KernelGemma3Ops(self.config, dtype, *tables, kern))
            self._ops_key = key
        return self._ops

    def _layer_places(self, place: list[tuple], attn: AttentionBackend, tables: dict) -> LayerPlaces | None:
        """Where each layer's attention runs, for :meth:`Kernels.gemma3_layers`; None unless
        every layer is on the attention kernels' path."""
        cols: list[list] = [[] for _ in LayerPlaces._fields]
        hd = self.config.head_dim
        for layer_id, (pool, j, pool_meta) in enumerate(place):
            caches = attn.layer_caches(pool, pool_meta)
            if caches is None:
                return None
            k, v = caches[0][j], caches[1][j]
            window = self.windows[layer_id]
            cos, sin = tables[window > 0]
            for col, value in zip(cols, (k, v, pool_meta.out_slots, pool_meta.slots, pool_meta.seq_info, window,
                                         cos, sin, attn.impl_for(k.dtype, hd), pool.kv_dtype)):
                col.append(value)
        return LayerPlaces(*cols)

    def _one_call_weights(self) -> Gemma3LayerWeights | None:
        """The per-layer lists :meth:`Kernels.gemma3_layers` takes (the Llama ones plus
        Gemma 3's norms), built once per packing; None where the layers cannot run in one call."""
        base = self.kernel_layers().one_call
        if not (self.one_call_layers and self.all_reduce is None and self.config.hidden_act == "gelu_pytorch_tanh"
                and base is not None):
            return None
        if self._g3_for is not base:
            ls = self.layers
            self._g3 = Gemma3LayerWeights(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                          qk_norm=[l.qk_norm for l in ls], norm_pre_ff=[l.pre_ff_norm for l in ls],
                                          norm_post_ff=[l.post_ff_norm for l in ls])
            self._g3_for = base
        return self._g3

    def _logits_of(self, x: torch.Tensor) -> torch.Tensor:
        out = super()._logits_of(x)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out

