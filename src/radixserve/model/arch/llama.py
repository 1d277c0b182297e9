"""A Llama / Qwen2 decoder that reads and writes its KV cache through slot indices.

The model never sees requests or the prefix tree: a :class:`ForwardBatch` says which new
tokens to run, at which positions, which slots receive their K/V and which slots each
sequence attends over. All KV-layout decisions live in the attention backend.

Numerics, and why:

* Weights are stored in the serving dtype (float32 or bfloat16) and every matmul runs in it.
* A bfloat16 model's linear weights (and a tied embedding / lm_head) may instead stay in a
  GGUF's quantized blocks or per-channel int8 (``radixserve.kernels.quant_weights``; the loader hands
  them over as ``QuantTensor``): they are packed as such and expand, step by step, to exactly
  the dense model's bfloat16 weights, so the model computes the same bits from fewer bytes.
  Wherever no kernel computes them (another backend, a float32 model, unpacked weights) they
  are dequantized at packing into the dense parameters.
* The residual stream, RMSNorm, rotary embeddings, attention and softmax run in float32:
  they are cheap next to the matmuls, and keeping them in float32 makes bfloat16 serving
  lose less quality than a pure-bfloat16 model (and keeps CPU SDPA on its fast path).
* q/k/v are one fused matmul and gate/up another (fused at load time): fewer, larger GEMMs
  are what a CPU or a GPU wants.
* The linear layers run on one backend per model (:mod:`radixserve.kernels.linear`): on CPU
  the packed GEMM of the kernels (float32 compute on float32 or bfloat16 weights; AVX2) or
  oneDNN on reordered weights (AVX-512, native bfloat16), else ``F.linear``. Weights are
  packed once at load and the dense copies dropped. Activations entering a linear are in
  ``linears.act_dtype`` (float32 for our GEMM, the weights' dtype for oneDNN / torch).
* Logits are float32 in every dtype: a bfloat16 model's lm_head runs with float32
  accumulation and output on its bfloat16 weights (``Linears.logits``; its input rows rounded
  to bfloat16 as the layers' are), since logits rounded to bfloat16 tie for tokens a few
  hundredths apart and greedy decoding would pick by id.
* The lm_head runs only on the rows whose logits are returned (:mod:`radixserve.model.arch.logits`),
  and on the kernels' path so does the last layer past its attention (``last_layer_rows_only``):
  every row's K/V are in the pool by then, and batch-invariant rows keep their bits.
* Between the matmuls, with an attention backend that provides kernels
  (``AttentionBackend.layer_kernels``, the default "torch" backend on CPU), each layer runs
  four fused row-wise ops from ``kernels/csrc``: residual add + RMSNorm (twice), RoPE in place
  on the qkv output, SiLU·mul. They compute in float32 and round once to the serving dtype;
  the eager torch ops ("torch-eager") are the reference they are tested against.
* Tensor parallelism hook: ``all_reduce`` (None = single device) is applied to the outputs of
  o_proj and down_proj before they enter the residual stream; sharding heads and the
  intermediate size is then a matter of slicing the weights. ``logits_gather`` likewise
  joins a vocabulary-parallel lm_head's logits (``radixserve/parallel/``).
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput
from radixserve.model.loaders.hf_weights import HFWeights
from radixserve.kernels.library import Kernels
from radixserve.kernels.operands import PackedWeight
from radixserve.kernels.quant_weights import QuantTensor
from radixserve.model.arch.layers import EmptyParams, RotaryTable, apply_rotary, rms_norm
from radixserve.kernels.linear import Linears, make_linears
from radixserve.model.arch.kernel_layers import KernelLayers
from radixserve.model.arch.logits import LogitRows

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """Weights of one decoder layer in fused form (qkv and gate_up concatenated)."""

    #: The layer's linear weights, in the order they are packed (one GEMM backend per model).
    LINEAR_NAMES: tuple[str, ...] = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * d

        p = EmptyParams(dtype, device)
        self.input_norm = p(h, dt=torch.float32)
        self.post_attn_norm = p(h, dt=torch.float32)
        self.qkv_weight = p(qkv_out, h)
        self.qkv_bias = p(qkv_out) if config.attention_bias else None
        self.o_weight = p(h, config.num_heads * d)
        self.gate_up_weight = p(2 * config.intermediate_size, h)
        self.down_weight = p(h, config.intermediate_size)
        # Linear weights loaded quantized (GGUF blocks, int8), by name, until they are packed:
        # their parameters above stay empty meanwhile.
        self.quant_weights: dict[str, QuantTensor] = {}


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 causal LM over a slot-indexed KV pool.

    Build with :meth:`from_state_dict` (Hugging Face naming); the constructor alone
    allocates uninitialised weights of the right shapes. Subclasses for other decoders
    (:mod:`radixserve.model.arch.gemma3`) reuse the loading, packing and logits code and replace
    ``layer_cls``, :meth:`check_config`, :meth:`_load_weights` and :meth:`_run_layers`.
    """

    layer_cls: type[DecoderLayer] = DecoderLayer
    ARCHS: tuple[str, ...] = ("llama", "qwen2")

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        self.check_config(config)
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        p = EmptyParams(dtype, self.device)
        self.embed_weight = p(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self._make_layer(i) for i in range(config.num_layers))
        self.final_norm = p(config.hidden_size, dt=torch.float32)
        self.lm_head_weight = (self.embed_weight if config.tie_word_embeddings
                               else p(config.vocab_size, config.hidden_size))
        self.rotary = RotaryTable(config, self.device, initial=min(4096, config.max_position_embeddings))
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        # How the linears run (dense F.linear until pack_linear_weights picks a backend).
        self.linears = Linears("torch", dtype, None)
        self._lm_head: tuple | None = None  # (kind, weight) once packed; None: dense lm_head_weight
        # A quantized embedding table / untied lm_head as loaded (None: dense), and the packed
        # table the embedding lookup expands its rows from (tied: the lm_head's own).
        self.embed_quant: QuantTensor | None = None
        self.lm_head_quant: QuantTensor | None = None
        self._embed_packed: PackedWeight | None = None
        # Sum of partial o_proj / down_proj outputs across tensor-parallel ranks (in place or
        # returning the sum); None on a single device.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Vocabulary-parallel lm_head: joins the ranks' logits columns (whole rows on the
        # rank that samples); None on a single device.
        self.logits_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._kernel_layers: KernelLayers | None = None  # see kernel_layers()

    def _make_layer(self, index: int) -> nn.Module:
        """The (uninitialised) weights of layer ``index``: ``layer_cls`` for every layer here;
        a model whose layers differ by kind (a hybrid of Mamba and attention) picks per layer."""
        return self.layer_cls(self.config, self.dtype, self.device)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """ValueError unless this class implements ``config`` (its arch and every feature)."""
        if config.arch not in cls.ARCHS:
            raise ValueError(f"{cls.__name__} runs arch {' / '.join(cls.ARCHS)}, not {config.arch!r} "
                             "(radixserve.model.create_model picks the class for a config)")
        unsupported = [name for name, on in (
            ("layer_types (sliding-window layers)", "sliding" in config.layer_types),
            ("hidden_act", config.hidden_act != "silu"),
            ("query_pre_attn_scalar", config.query_pre_attn_scalar is not None),
            ("final_logit_softcapping", config.final_logit_softcapping is not None),
        ) if on]
        if unsupported:
            raise ValueError(f"{cls.__name__} does not implement ModelConfig.{unsupported[0]}")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pack_weights: bool | None = None,
        cpu_isa: str = "auto",
        linear_backend: str = "auto",
    ) -> "LlamaForCausalLM":
        """Build the model from a Hugging Face-named state dict (see :meth:`load_hf_state_dict`).

        ``linear_backend`` (:mod:`radixserve.kernels.linear`; ``auto`` = the best for this CPU
        under the instruction-set cap ``cpu_isa``) packs the linear weights once.
        ``pack_weights=False`` keeps dense ``F.linear`` whatever the backend."""
        model = cls(config, dtype=dtype, device=device)
        model.load_hf_state_dict(state_dict)
        if pack_weights is not False:
            model.pack_linear_weights(linear_backend, cpu_isa)
            if pack_weights and not model.packed:
                raise ValueError(f"pack_weights=True: no packed linear backend serves device "
                                 f"{model.device}, dtype {dtype}")
        model.dequantize_weights()  # whatever the packing left quantized (dense F.linear)
        return model

    def weight_formats(self) -> tuple[str, ...]:
        """The quantized formats the model computes in (GGUF types, ``int8``), by first use."""
        qts = [self.embed_quant, self.lm_head_quant] + [q for l in self.layers for q in l.quant_weights.values()]
        formats = dict.fromkeys(f for q in qts if q is not None for f in q.labels)
        return tuple(formats) + tuple(f for f in getattr(self, "_packed_formats", ()) if f not in formats)

    @torch.no_grad()
    def dequantize_weights(self) -> None:
        """Every weight still held quantized, dequantized into its dense parameter (in the
        model's dtype): what runs where no kernel computes the blocks."""
        def dense(q: QuantTensor) -> torch.Tensor:
            return q.dequantize().to(device=self.device, dtype=self.dtype).contiguous()

        for layer in self.layers:
            for name, q in layer.quant_weights.items():
                getattr(layer, name).data = dense(q)
            layer.quant_weights = {}
        if self.embed_quant is not None:
            self.embed_weight.data = dense(self.embed_quant)
            self.embed_quant = None
            self._embed_packed = None
        if self.lm_head_quant is not None:
            self.lm_head_weight.data = dense(self.lm_head_quant)
            self.lm_head_quant = None

    @property
    def packed(self) -> bool:
        """Whether the linear weights are packed (not plain ``F.linear``)."""
        return self.linears.packed

    @torch.no_grad()
    def pack_linear_weights(self, backend: str = "auto", cpu_isa: str = "auto") -> bool:
        """Pack every linear weight (and the lm_head) for ``backend``, in place.

        The dense layer weights are dropped (the packed copies replace them, so memory does
        not double); a tied lm_head gets its own packed copy since the embedding table must
        stay dense for lookups. All-or-nothing: on a packing error the model keeps its dense
        weights, logs why, and returns False."""
        if self.packed:
            return True
        linears = make_linears(backend, self.device, self.dtype, cpu_isa)
        if not linears.quant:
            self.dequantize_weights()  # quantized blocks run only as the bf16 dot products
        if not linears.packed:
            self.linears = linears
            self._lm_head = linears.pack_lm_head(self.lm_head_weight.data)
            return False
        lm_head_w = self.lm_head_quant if self.lm_head_weight is not self.embed_weight else self.embed_quant
        try:
            names = [l.LINEAR_NAMES for l in self.layers]
            flat = linears.pack_many([l.quant_weights.get(n, getattr(l, n).data)
                                      for l, ns in zip(self.layers, names) for n in ns])
            packed, at = [], 0
            for ns in names:
                packed.append(dict(zip(ns, flat[at:at + len(ns)])))
                at += len(ns)
            lm_head = linears.pack_lm_head(lm_head_w if lm_head_w is not None else self.lm_head_weight.data)
            embed = None
            if self.embed_quant is not None:
                embed = lm_head[1] if lm_head_w is self.embed_quant else linears.pack_table(self.embed_quant)
        except RuntimeError as e:
            log.warning("packing the linear weights for %s failed, keeping F.linear: %s", linears.backend, e)
            self.dequantize_weights()
            return False
        self._packed_formats = self.weight_formats()
        for layer in self.layers:
            layer.quant_weights = {}
        self.embed_quant = self.lm_head_quant = None
        self._embed_packed = embed
        for layer, weights in zip(self.layers, packed):
            if layer.qkv_bias is not None and linears.act_dtype == torch.float32:
                layer.qkv_bias.data = layer.qkv_bias.data.float()  # added in float32
            for name, w in weights.items():
                delattr(layer, name)
                if isinstance(w, torch.Tensor):
                    layer.register_buffer(name, w, persistent=False)
                else:
                    setattr(layer, name, w)
        self.linears = linears
        self._lm_head = lm_head
        return True

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up; strict about names and shapes.

        Unknown keys raise (a silently ignored tensor is a loading bug waiting to show up as
        garbage text); ``lm_head.weight`` is accepted and ignored when embeddings are tied,
        and ``rotary_emb.inv_freq`` buffers are ignored (we recompute them). Tensors already
        in the right dtype/device (norms, embeddings) are shared with ``state_dict``, not
        copied, so loading does not double peak memory; do not mutate the dict afterwards.
        """
        if self.packed:
            raise RuntimeError("load_hf_state_dict after pack_linear_weights: build a new model")
        weights = HFWeights(state_dict, self.device)
        self._load_weights(weights)
        weights.check_all_used()

    def _load_weights(self, weights: HFWeights) -> None:
        """Every weight of the model from the HF names (see :meth:`load_hf_state_dict`)."""
        cfg = self.config
        get, put, used = weights.get, weights.put, weights.used
        h, d = cfg.hidden_size, cfg.head_dim
        qs, kvs = cfg.num_heads * d, cfg.num_kv_heads * d
        embed = get("model.embed_tokens.weight", (cfg.vocab_size, h))
        if isinstance(embed, QuantTensor):
            self.embed_quant = embed
            self.embed_weight.data = torch.empty((0, h), dtype=self.dtype, device=self.device)
        else:
            put(self.embed_weight, embed)

        def linear(layer: DecoderLayer, name: str, *parts: torch.Tensor | QuantTensor) -> None:
            # Kept quantized when every part is; else dense (the dense model's values).
            if all(isinstance(p, QuantTensor) for p in parts):
                layer.quant_weights[name] = QuantTensor.cat(parts)
                getattr(layer, name).data = torch.empty(0, dtype=self.dtype, device=self.device)
                return
            dense = [p.dequantize().to(self.dtype) if isinstance(p, QuantTensor) else p for p in parts]
            put(getattr(layer, name), dense[0] if len(dense) == 1 else torch.cat(dense, dim=0))

        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            put(layer.input_norm, get(pre + "input_layernorm.weight", (h,)))
            put(layer.post_attn_norm, get(pre + "post_attention_layernorm.weight", (h,)))
            q = get(pre + "self_attn.q_proj.weight", (qs, h))
            k = get(pre + "self_attn.k_proj.weight", (kvs, h))
            v = get(pre + "self_attn.v_proj.weight", (kvs, h))
            linear(layer, "qkv_weight", q, k, v)
            if layer.qkv_bias is not None:
                qb = get(pre + "self_attn.q_proj.bias", (qs,))
                kb = get(pre + "self_attn.k_proj.bias", (kvs,))
                vb = get(pre + "self_attn.v_proj.bias", (kvs,))
                put(layer.qkv_bias, torch.cat((qb, kb, vb)))
            linear(layer, "o_weight", get(pre + "self_attn.o_proj.weight", (h, qs)))
            g = get(pre + "mlp.gate_proj.weight", (cfg.intermediate_size, h))
            u = get(pre + "mlp.up_proj.weight", (cfg.intermediate_size, h))
            linear(layer, "gate_up_weight", g, u)
            linear(layer, "down_weight", get(pre + "mlp.down_proj.weight", (h, cfg.intermediate_size)))
        put(self.final_norm, get("model.norm.weight", (h,)))
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_weight
            used.add("lm_head.weight")
        else:
            head = get("lm_head.weight", (cfg.vocab_size, h))
            if isinstance(head, QuantTensor):
                self.lm_head_quant = head
                self.lm_head_weight.data = torch.empty((0, h), dtype=self.dtype, device=self.device)
            else:
                put(self.lm_head_weight, head)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend
    ) -> ForwardOutput:
        """Run the new tokens of every sequence; return last-token (and asked-for) logits."""
        self._check_forward(batch, kv_pool)
        meta = self._prepare_attention(batch, kv_pool, attn)
        max_pos = max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens))
        for table in self._rotary_tables():
            table.ensure(max_pos)
        kern = attn.layer_kernels(self.dtype, self.device)
        rows = LogitRows(batch, batch.input_ids.numel(), self.device)
        # Not under tensor parallelism: a worker that computes no logits would select no rows
        # and skip the all-reduces of the last layer that the other ranks wait in.
        tail = rows.rows if self.last_layer_rows_only and self.all_reduce is None else None
        hidden = self._run_layers(batch, kv_pool, attn, meta, kern, tail)
        return rows.logits(hidden, self._head, self.config.vocab_size)

    def _prepare_attention(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend) -> object:
        """The attention backend's per-forward metadata, shared by every layer."""
        return attn.prepare(batch, kv_pool)

    def _check_forward(self, batch: ForwardBatch, kv_pool: KVPool) -> None:
        cfg = self.config
        if kv_pool.num_layers != cfg.num_layers:
            raise ValueError(f"kv_pool.num_layers is {kv_pool.num_layers}, model has {cfg.num_layers}")
        if kv_pool.num_kv_heads != cfg.num_kv_heads or kv_pool.head_dim != cfg.head_dim:
            raise ValueError(f"kv_pool (kv_heads={kv_pool.num_kv_heads}, head_dim={kv_pool.head_dim}) does "
                             f"not match the model ({cfg.num_kv_heads}, {cfg.head_dim})")
        t = batch.input_ids.numel()
        if batch.positions.numel() != t or batch.out_slots.numel() != t:
            raise ValueError(f"ForwardBatch.positions ({batch.positions.numel()}) and out_slots "
                             f"({batch.out_slots.numel()}) must match input_ids ({t})")
        if batch.input_embeds is not None:
            if cfg.arch not in LlamaForCausalLM.ARCHS:
                raise ValueError(f"ForwardBatch.input_embeds is not supported for arch {cfg.arch!r}")
            if tuple(batch.input_embeds.shape) != (t, cfg.hidden_size):
                raise ValueError(f"ForwardBatch.input_embeds must be [{t}, {cfg.hidden_size}], "
                                 f"got {list(batch.input_embeds.shape)}")

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``input_ids`` in the model's dtype: looked up in the dense
        table, or expanded from the quantized one (the same values)."""
        if self._embed_packed is not None:
            kern = self.linears.kernels
            return kern.quant_rows(self._embed_packed, input_ids).view(*input_ids.shape, -1)
        return F.embedding(input_ids, self.embed_weight)

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The float32 residual stream's first value (a fresh tensor, updated in place):
        the embeddings of ``input_ids``, or ``batch.input_embeds`` when given."""
        if batch.input_embeds is not None:
            return batch.input_embeds.to(device=self.device, dtype=torch.float32, copy=True)
        return self.embed_tokens(batch.input_ids).to(torch.float32, copy=True)

    def _rotary_tables(self) -> tuple[RotaryTable, ...]:
        """The cos/sin tables the layers read (grown to the batch's positions per forward)."""
        return (self.rotary,)

    def _run_layers(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend,
                    meta: object, kern: Kernels | None, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers (fused kernels when the backend offers them); the residual:
        every row, or only the ``tail`` rows where the path runs its last layer on them alone
        (the kernels' path, whose rows are batch-invariant; the eager path ignores it)."""
        if kern is not None:
            return self._layers_fused(batch, kv_pool, attn, meta, kern, tail)
        return self._layers_eager(batch, kv_pool, attn, meta)

    def _layers_eager(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend,
                      meta: object) -> torch.Tensor:
        """The decoder layers in plain torch ops: the reference path. Returns the residual."""
        cfg = self.config
        t = batch.input_ids.numel()
        cos, sin = self.rotary.lookup(batch.positions)
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, kvs = self._q_size, self._kv_size
        inter = cfg.intermediate_size
        eps = cfg.rms_norm_eps
        reduce = self.all_reduce

        linear = self.linears
        dtype = linear.act_dtype
        # The residual stream is float32 (a fresh tensor, safe to update in place).
        hidden = self._embed(batch)
        for layer_id, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps).to(dtype)
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias)  # [T, (H + 2 KV) * D]
            qk = qkv[:, : qs + kvs].float().view(t, nh + nkv, hd)
            qk = apply_rotary(qk, cos, sin)
            v = qkv[:, qs + kvs :].float().view(t, nkv, hd)
            o = attn.forward(qk[:, :nh], qk[:, nh:], v, layer_id, kv_pool, meta)  # [T, H * D] float32
            # In-place adds / activations: on a CPU every fresh multi-MB tensor costs page
            # faults, so the residual stream and the gate half are updated where they lie.
            d = linear(o.to(dtype), layer.o_weight)
            hidden.add_(reduce(d) if reduce is not None else d)
            x = rms_norm(hidden, layer.post_attn_norm, eps).to(dtype)
            gu = linear(x, layer.gate_up_weight)
            act = F.silu(gu[:, :inter], inplace=True).mul_(gu[:, inter:])
            d = linear(act, layer.down_weight)
            hidden.add_(reduce(d) if reduce is not None else d)
        return hidden

    def _layers_fused(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend,
                      meta: object, kern: Kernels, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers with the fused row-wise kernels (:class:`KernelLayers`)."""
        return self.kernel_layers().run(self._embed(batch), batch.positions, (self.rotary.cos, self.rotary.sin),
                                        kv_pool, attn, meta, kern, self.all_reduce, self.one_call_layers, tail,
                                        self.fused_gate_up)

    # Whether a kernel-path forward runs all its layers in one C++ call (Kernels.llama_layers:
    # the same kernels in the same order, so the same bits); False runs them from Python.
    one_call_layers = True
    # Whether the kernels' path runs the last layer past its attention on the rows whose logits
    # are returned only (LogitRows): the same bits for those rows, since they are batch-invariant
    # (tests turn it off to compare).
    last_layer_rows_only = True
    # Whether the kernels' GEMM runs gate_up and its gate in one pass where it can
    # (Kernels.gated_linear: the same bits as the two passes; benchmarks turn it off to compare).
    fused_gate_up = True

    def kernel_layers(self) -> KernelLayers:
        """The layers' kernel path for the current packing (built again after a repacking)."""
        if self._kernel_layers is None or self._kernel_layers.linears is not self.linears:
            self._kernel_layers = KernelLayers(self.config, self.layers, self.linears)
        return self._kernel_layers

    def _logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final-normed float32 rows ``x`` (vocabulary-parallel under TP)."""
        out = self.linears.logits(x, self._lm_head or ("dense", self.lm_head_weight))
        return out if self.logits_gather is None else self.logits_gather(out)

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head of float32 residual rows; float32 logits."""
        return self._logits_of(rms_norm(rows, self.final_norm, self.config.rms_norm_eps))
