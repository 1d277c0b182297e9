"""Bamba: a hybrid decoder of Mamba2 (SSD) layers and attention layers, over a slot-indexed
KV pool (the attention layers) and a slot-indexed Mamba state pool (the Mamba layers).

Checked against transformers' ``BambaForCausalLM``. Every layer is ``h += mixer(norm(h));
h += mlp(norm(h))`` with a SwiGLU MLP; the mixer is either

* attention (``layer_types[i] == "full"``): Llama's, except that RoPE rotates only the
  leading ``partial_rotary_factor`` of each head (Bamba: half; transformers hard-codes it),
  and its K/V live in a pool of the attention layers only; or
* a Mamba2 mixer (``"mamba"``): ``in_proj`` gives the gate ``z``, the conv input ``xBC`` and
  ``dt``; a causal depthwise conv (``d_conv`` taps, bias) and SiLU over ``xBC``; split into
  the scan input ``x`` (heads x head_dim), ``B`` and ``C`` (groups x d_state, shared by the
  heads of a group); per token ``dt = clamp(softplus(dt + dt_bias))``, ``state = state *
  exp(dt * A) + (dt * B) x``, ``y = state . C + D x``; then the gated RMSNorm
  ``norm_g(y * silu(z)) * w`` per group, and ``out_proj``.

Why the scan is a strict per-token recurrence in float32 (transformers' prefill runs the
chunked SSD algorithm instead): the state after ``n`` tokens must be the same bits however
the tokens were split into steps (a whole prompt, chunks of a chunked prefill, a prefix from
a cached snapshot plus the rest, decode steps), or a cached state would not be the state a
request computing from scratch reaches, and greedy output with the cache on would drift from
the cache off. For the same reason every operation of the mixer runs on one token's row at a
time: torch's vectorised transcendental functions (exp, softplus, SiLU) may round an element
differently from the scalar loop that finishes a tensor's tail, so an element's bits would
depend on where it sits in a batch. Each sequence's state is read from and written back to its
own slot (``ForwardBatch.state_slots``), so a request never sees its batch neighbours.

A speculative decoding step's row (``ForwardBatch.state_staged``: its last token and a draft)
runs the same scan, so each of its positions gets the bits a decode step would, but leaves
its slot as it was: which positions are kept is known only after sampling, and a recurrent
state cannot be cut back. :class:`VerifiedScan` keeps what it takes to set the state after
any number of them (``MambaStatePool.settle``, called by the scheduler).

Numerics otherwise follow llama.py: float32 residual stream, norms, RoPE and attention;
linears in the serving dtype on the model's linear backend (the packed GEMM's per-row chains
by default); the Mamba parameters (conv, dt_bias, A, D, the gated norm) in float32. With an
attention backend that provides kernels, the RMSNorms and the MLP's SiLU-mul run as the fused
row kernels (one reduction order per row, whatever the batch).

Not implemented (the engine refuses them, naming the flag): tensor parallelism, quantized
weights, biases on the projections (``attention_bias``, ``mlp_bias``, ``mamba_proj_bias``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.library import Kernels
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.mamba import MambaStatePool
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.loaders.hf_weights import HFWeights
from radixserve.model.arch.layers import EmptyParams, RotaryTable, apply_rotary, rms_norm
from radixserve.model.arch.llama import DecoderLayer, LlamaForCausalLM

__all__ = ["BambaForCausalLM", "MambaLayer", "VerifiedScan", "make_state_pool"]


def advance(state: torch.Tensor, step: torch.Tensor, a: torch.Tensor, b: torch.Tensor, xs: torch.Tensor) -> None:
    """One token's SSM update of ``state`` [heads, head_dim, d_state] in place: ``state *
    exp(dt * A) + (dt * B) x``. The scan and :meth:`VerifiedScan.keep` both call it, so a
    state replayed from staged inputs has the scan's bits."""
    state.mul_(torch.exp(step * a)[:, None, None]).add_((step[:, None] * b)[:, None, :] * xs[:, :, None])


@dataclasses.dataclass
class LayerSteps:
    """One Mamba layer's part of a staged step: the slot's views (still the state before the
    step), the conv's inputs over the step, the SSM state after its last position, and each
    position's scan inputs (``dt`` [heads], ``B`` [heads, d_state], ``x`` [heads, head_dim])."""

    conv: torch.Tensor
    ssm: torch.Tensor
    window: torch.Tensor
    final: torch.Tensor
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    a: torch.Tensor


class VerifiedScan:
    """The Mamba layers of a speculative step's row, staged (``MambaStatePool.stage``) until
    the scheduler knows how many of its positions are kept.

    Replay, not a copy per position: the conv state after any position is a slice of the
    step's conv inputs, and the SSM state after position ``r`` is the state before the step
    advanced by the first ``r`` positions' scan inputs (a few vectors per position, where a
    state is ``heads x head_dim x d_state`` per layer). A fully kept step takes the scan's own
    final state; a partly kept one replays only the kept positions' updates (no projections,
    no conv), with :func:`advance`, so the bits are the scan's. What a staged step holds until
    it is settled: one state per layer (the scan's final one) and the inputs."""

    def __init__(self) -> None:
        self.layers: list[LayerSteps] = []

    def keep(self, rows: int) -> None:
        """Every staged layer's slot becomes its state after the step's first ``rows``
        positions (0: as before the step)."""
        for ls in self.layers:
            e = len(ls.inputs)
            if not 0 <= rows <= e:
                raise ValueError(f"keep: {rows} rows of a staged step of {e}")
            taps_1 = ls.conv.shape[0]
            ls.conv.copy_(ls.window[rows : rows + taps_1])
            if rows == e:
                ls.ssm.copy_(ls.final)
                continue
            for step, b, xs in ls.inputs[:rows]:
                advance(ls.ssm, step, ls.a, b, xs)


class MambaLayer(nn.Module):
    """One Mamba2 layer's weights (plus its MLP's, as every Bamba layer has one)."""

    LINEAR_NAMES = ("in_proj_weight", "out_proj_weight", "gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, inner, cd = config.hidden_size, config.mamba_inner, config.mamba_conv_dim
        nh = config.mamba_n_heads

        p = EmptyParams(dtype, device)
        f32 = torch.float32
        self.input_norm = p(h, dt=f32)
        self.post_attn_norm = p(h, dt=f32)  # the MLP's input norm (HF: pre_ff_layernorm)
        self.in_proj_weight = p(inner + cd + nh, h)
        self.out_proj_weight = p(h, inner)
        self.gate_up_weight = p(2 * config.intermediate_size, h)
        self.down_weight = p(h, config.intermediate_size)
        self.conv_weight = p(config.mamba_d_conv, cd, dt=f32)  # taps-major: a tap's row is contiguous
        self.conv_bias = p(cd, dt=f32) if config.mamba_conv_bias else None
        self.dt_bias = p(nh, dt=f32)
        self.A = p(nh, dt=f32)  # -exp(A_log), formed at load time
        self.D = p(nh, dt=f32)
        self.norm_weight = p(inner, dt=f32)
        self.qkv_bias = None  # (what the weight packing asks every layer)
        self.quant_weights: dict = {}  # never quantized (see the module docstring)


def make_state_pool(config: ModelConfig, capacity: int, device: str | torch.device = "cpu") -> MambaStatePool:
    """A state pool of ``capacity`` slots shaped for ``config``'s Mamba layers."""
    if not config.mamba_layers:
        raise ValueError(f"model arch {config.arch!r} has no Mamba layers: it keeps no recurrent state")
    return MambaStatePool(len(config.mamba_layers), capacity, config.mamba_conv_dim, config.mamba_d_conv,
                          config.mamba_n_heads, config.mamba_head_dim, config.mamba_d_state, device)


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba causal LM; see the module docstring. :meth:`bind_states` gives it the state pool
    its Mamba layers read and write (the runner does, once)."""

    ARCHS = ("bamba",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__(config, dtype, device)
        rot = int(config.head_dim * config.partial_rotary_factor)
        self.rotary_dim = rot
        self.rotary = RotaryTable(dataclasses.replace(config, head_dim=rot, partial_rotary_factor=1.0),
                                  self.device, initial=min(4096, config.max_position_embeddings))
        #: Per layer: its index in the KV pool (attention) or in the state pool (Mamba).
        kv, mamba = config.attention_layers, config.mamba_layers
        self.pool_index = [kv.index(i) if i in kv else mamba.index(i) for i in range(config.num_layers)]
        self.is_mamba = [i in mamba for i in range(config.num_layers)]
        self.states: MambaStatePool | None = None

    def _make_layer(self, index: int) -> nn.Module:
        if self.config.layer_types[index] == "mamba":
            return MambaLayer(self.config, self.dtype, self.device)
        return DecoderLayer(self.config, self.dtype, self.device)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.arch not in cls.ARCHS:
            raise ValueError(f"{cls.__name__} runs arch bamba, not {config.arch!r}")
        if "sliding" in config.layer_types:
            raise ValueError(f"{cls.__name__} does not implement sliding-window layers (ModelConfig.layer_types)")
        if not config.mamba_layers:
            raise ValueError(f"{cls.__name__} needs Mamba layers (ModelConfig.layer_types)")
        if config.attention_bias:
            raise ValueError(f"{cls.__name__} does not implement ModelConfig.attention_bias")
        if config.hidden_act != "silu":
            raise ValueError(f"{cls.__name__} does not implement ModelConfig.hidden_act {config.hidden_act!r}")

    def bind_states(self, pool: MambaStatePool) -> None:
        """The state pool the Mamba layers read and write, by ``ForwardBatch.state_slots``."""
        c = self.config
        want = (len(c.mamba_layers), c.mamba_d_conv - 1, c.mamba_conv_dim, c.mamba_n_heads, c.mamba_head_dim,
                c.mamba_d_state)
        got = (pool.num_layers, *pool.conv.shape[2:], *pool.ssm.shape[2:])
        if got != want:
            raise ValueError(f"state pool shaped {got} (layers, taps-1, conv_dim, heads, head_dim, d_state) does "
                             f"not match the model's {want}")
        self.states = pool

    # ------------------------------------------------------------------ loading
    def _load_weights(self, weights: HFWeights) -> None:
        cfg = self.config
        get, put = weights.get, weights.put
        h, d = cfg.hidden_size, cfg.head_dim
        qs, kvs = cfg.num_heads * d, cfg.num_kv_heads * d
        inner, cd, nh, ff = cfg.mamba_inner, cfg.mamba_conv_dim, cfg.mamba_n_heads, cfg.intermediate_size
        put(self.embed_weight, get("model.embed_tokens.weight", (cfg.vocab_size, h)))
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            put(layer.input_norm, get(pre + "input_layernorm.weight", (h,)))
            put(layer.post_attn_norm, get(pre + "pre_ff_layernorm.weight", (h,)))
            put(layer.gate_up_weight, torch.cat((get(pre + "feed_forward.gate_proj.weight", (ff, h)),
                                                 get(pre + "feed_forward.up_proj.weight", (ff, h)))))
            put(layer.down_weight, get(pre + "feed_forward.down_proj.weight", (h, ff)))
            if isinstance(layer, MambaLayer):
                m = pre + "mamba."
                put(layer.in_proj_weight, get(m + "in_proj.weight", (inner + cd + nh, h)))
                put(layer.out_proj_weight, get(m + "out_proj.weight", (h, inner)))
                put(layer.conv_weight, get(m + "conv1d.weight", (cd, 1, cfg.mamba_d_conv)).reshape(cd, -1).t())
                if layer.conv_bias is not None:
                    put(layer.conv_bias, get(m + "conv1d.bias", (cd,)))
                put(layer.dt_bias, get(m + "dt_bias", (nh,)))
                put(layer.A, -torch.exp(get(m + "A_log", (nh,)).float()))
                put(layer.D, get(m + "D", (nh,)))
                put(layer.norm_weight, get(m + "norm.weight", (inner,)))
            else:
                a = pre + "self_attn."
                put(layer.qkv_weight, torch.cat((get(a + "q_proj.weight", (qs, h)), get(a + "k_proj.weight", (kvs, h)),
                                                 get(a + "v_proj.weight", (kvs, h)))))
                put(layer.o_weight, get(a + "o_proj.weight", (h, qs)))
        put(self.final_norm, get("model.final_layernorm.weight", (h,)))
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_weight
            weights.used.add("lm_head.weight")
        else:
            put(self.lm_head_weight, get("lm_head.weight", (cfg.vocab_size, h)))

    # ------------------------------------------------------------------ forward
    def _check_forward(self, batch: ForwardBatch, kv_pool: KVPool) -> None:
        cfg = self.config
        if kv_pool.num_layers != len(cfg.attention_layers):
            raise ValueError(f"kv_pool.num_layers is {kv_pool.num_layers}, the model has "
                             f"{len(cfg.attention_layers)} attention layers")
        if kv_pool.num_kv_heads != cfg.num_kv_heads or kv_pool.head_dim != cfg.head_dim:
            raise ValueError(f"kv_pool (kv_heads={kv_pool.num_kv_heads}, head_dim={kv_pool.head_dim}) does "
                             f"not match the model ({cfg.num_kv_heads}, {cfg.head_dim})")
        if self.states is None:
            raise ValueError("BambaForCausalLM needs its state pool: call bind_states first")
        if len(batch.state_slots) != batch.num_seqs:
            raise ValueError(f"ForwardBatch.state_slots has {len(batch.state_slots)} entries, expected one per "
                             f"sequence ({batch.num_seqs})")
        if len(set(batch.state_slots)) != len(batch.state_slots):
            raise ValueError("ForwardBatch.state_slots: two sequences share a state slot")
        for s in batch.state_slots:
            self.states._check(s)
        if batch.state_staged and len(batch.state_staged) != batch.num_seqs:
            raise ValueError(f"ForwardBatch.state_staged has {len(batch.state_staged)} entries, expected one per "
                             f"sequence ({batch.num_seqs})")
        if batch.input_embeds is not None:
            raise ValueError("ForwardBatch.input_embeds is not supported for arch 'bamba'")

    def _run_layers(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend,
                    meta: object, kern: Kernels | None, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers; returns the float32 residual stream, every row (``tail`` is
        not used: the rows are selected for the lm_head afterwards)."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        linear = self.linears
        dtype = linear.act_dtype
        inter = cfg.intermediate_size
        if kern is not None:
            def norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return kern.rms_norm(h, w, eps, dtype)

            act_mul = kern.silu_mul
        else:
            def norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return rms_norm(h, w, eps).to(dtype)

            def act_mul(gu: torch.Tensor) -> torch.Tensor:
                return F.silu(gu[:, :inter]).mul_(gu[:, inter:])

        cos, sin = self.rotary.lookup(batch.positions)
        hidden = self._embed(batch)
        staged = self._stage(batch)
        for layer_id, layer in enumerate(self.layers):
            x = norm(hidden, layer.input_norm)
            if self.is_mamba[layer_id]:
                d = self._mamba(layer, self.pool_index[layer_id], x, batch, staged)
            else:
                d = self._attention(layer, self.pool_index[layer_id], x, cos, sin, kv_pool, attn, meta)
            hidden.add_(d)
            x = norm(hidden, layer.post_attn_norm)
            hidden.add_(linear(act_mul(linear(x, layer.gate_up_weight)), layer.down_weight))
        return hidden

    def _attention(self, layer: DecoderLayer, j: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_pool: KVPool, attn: AttentionBackend, meta: object) -> torch.Tensor:
        """An attention layer's output rows (before the residual add); K/V go to pool layer ``j``."""
        cfg = self.config
        t = x.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, kvs, rot = self._q_size, self._kv_size, self.rotary_dim
        qkv = self.linears(x, layer.qkv_weight)
        qk = qkv[:, : qs + kvs].float().view(t, nh + nkv, hd)
        if rot < hd:  # RoPE on the leading rot dims of each head; the rest passes through
            qk = torch.cat((apply_rotary(qk[..., :rot], cos, sin), qk[..., rot:]), dim=-1)
        else:
            qk = apply_rotary(qk, cos, sin)
        v = qkv[:, qs + kvs :].float().view(t, nkv, hd)
        o = attn.forward(qk[:, :nh], qk[:, nh:], v, j, kv_pool, meta)
        dtype = self.linears.act_dtype
        return self.linears(o if o.dtype == dtype else o.to(dtype), layer.o_weight)

    def _stage(self, batch: ForwardBatch) -> list[VerifiedScan | None]:
        """Per sequence, the :class:`VerifiedScan` its Mamba layers fill instead of writing its
        slot (``ForwardBatch.state_staged``), staged in the pool; None where the slot is
        advanced in place."""
        if not batch.state_staged:
            return [None] * batch.num_seqs
        out: list[VerifiedScan | None] = []
        for slot, stage in zip(batch.state_slots, batch.state_staged):
            scan = VerifiedScan() if stage else None
            if scan is not None:
                self.states.stage(slot, scan)
            out.append(scan)
        return out

    def _mamba(self, layer: MambaLayer, j: int, x: torch.Tensor, batch: ForwardBatch,
               staged: list[VerifiedScan | None]) -> torch.Tensor:
        """A Mamba layer's output rows (before the residual add); each sequence advances the
        state in its slot of state-pool layer ``j``, or adds this layer to its ``staged`` scan."""
        cfg = self.config
        inner, cd = cfg.mamba_inner, cfg.mamba_conv_dim
        zxbcdt = self.linears(x, layer.in_proj_weight).float()
        y = torch.empty((x.shape[0], inner), dtype=torch.float32)
        conv, ssm = self.states.conv[j], self.states.ssm[j]
        off = 0
        for e, slot, scan in zip(batch.extend_lens, batch.state_slots, staged):
            rows = zxbcdt[off : off + e]
            self._scan(layer, conv[slot], ssm[slot], rows[:, :inner], rows[:, inner : inner + cd],
                       rows[:, inner + cd :], y[off : off + e], None if scan is None else scan.layers)
            off += e
        dtype = self.linears.act_dtype
        return self.linears(y if y.dtype == dtype else y.to(dtype), layer.out_proj_weight)

    def _scan(self, layer: MambaLayer, conv_state: torch.Tensor, ssm_state: torch.Tensor, z: torch.Tensor,
              xbc: torch.Tensor, dt: torch.Tensor, out: torch.Tensor,
              staged: list[LayerSteps] | None = None) -> None:
        """One sequence through the conv, the scan and the gated norm, token by token (see the
        module docstring for why); ``conv_state`` / ``ssm_state`` (its slot's views) are
        advanced in place, the gated-norm rows written to ``out``. With ``staged`` (a
        speculative step's row) the slot is left as it is and this layer's steps are
        appended there instead (:class:`VerifiedScan`)."""
        cfg = self.config
        inner, nh, hd = cfg.mamba_inner, cfg.mamba_n_heads, cfg.mamba_head_dim
        groups, n = cfg.mamba_n_groups, cfg.mamba_d_state
        taps = cfg.mamba_d_conv
        rep = nh // groups
        lo, hi = cfg.mamba_dt_limit
        eps = cfg.rms_norm_eps
        w, bias = layer.conv_weight, layer.conv_bias
        dt_bias, a, d_skip, norm_w = layer.dt_bias, layer.A, layer.D[:, None], layer.norm_weight
        window = torch.cat((conv_state, xbc))  # [taps - 1 + e, conv_dim]: the conv's inputs, oldest first
        state = ssm_state.clone()
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i in range(xbc.shape[0]):
            c = window[i] * w[0]
            for k in range(1, taps):
                c.add_(window[i + k] * w[k])
            if bias is not None:
                c.add_(bias)
            c = F.silu(c)
            xs = c[:inner].view(nh, hd)
            b = c[inner : inner + groups * n].view(groups, n).repeat_interleave(rep, dim=0)  # [nh, n]
            cc = c[inner + groups * n :].view(groups, n).repeat_interleave(rep, dim=0)
            step = F.softplus(dt[i] + dt_bias).clamp_(lo, hi)  # [nh]
            advance(state, step, a, b, xs)
            if staged is not None:
                inputs.append((step, b, xs))
            yi = (state * cc[:, None, :]).sum(-1).add_(xs * d_skip).view(inner)
            g = (yi * F.silu(z[i])).view(groups, inner // groups)
            out[i] = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(inner) * norm_w
        if staged is not None:
            staged.append(LayerSteps(conv_state, ssm_state, window, state, inputs, a))
            return
        conv_state.copy_(window[window.shape[0] - (taps - 1) :])
        ssm_state.copy_(state)
