"""A seeded random tiny Llama for fast tests: real architecture, meaningless weights.

Sized so that a full forward takes milliseconds on a CPU but every structural feature is
exercised: 2 layers (layer indexing), GQA (4 query heads over 2 KV heads), tied embeddings.
Weights use std 0.2 and the norm weights are ``1 + 0.2 * randn`` rather than ones, so a
loading mistake (a swapped or missing norm, a transposed projection) changes the logits
visibly instead of hiding behind identity-like weights.

``arch="gemma3"`` gives a tiny Gemma 3 instead: 6 layers alternating two sliding-window
layers (window 12, so a 40-token prompt crosses it several times) and one full layer, MQA
(4 query heads over 1 KV head), head_dim 32 (q is wider than the hidden size, as in Gemma),
query_pre_attn_scalar 24 (not head_dim: the scale is tested), GeGLU, the Gemma norms (stored
as ``w`` for ``1 + w``: ``0.2 * randn``) and per-head q/k norms.

``arch="bamba"`` gives a tiny Bamba (``tiny-random-mamba-hybrid``): 6 layers, two Mamba2 layers
to one attention layer (so the state and the KV both carry information forward), Mamba heads
in 2 groups (B and C shared per group: the head-to-group mapping is tested), d_state 16, a
4-tap conv with bias, GQA attention with RoPE on half of each head (Bamba's partial rotary),
an untied lm_head. ``A_log`` starts at ``log(1..heads)`` as Bamba initialises it, so the heads
forget at different rates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.model.model_config import ModelConfig


# What the tiny models share; each architecture's entries override these.
_TINY_COMMON: dict[str, object] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}
_TINY_ARCHS: dict[str, dict[str, object]] = {
    "gemma3": {
        "num_layers": 6, "num_kv_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "sliding_window": 12, "layer_types": ("sliding", "sliding", "full") * 2, "rope_local_theta": 10_000.0,
        "query_pre_attn_scalar": 24, "hidden_act": "gelu_pytorch_tanh",
    },
    "bamba": {
        "num_layers": 6, "num_kv_heads": 2, "tie_word_embeddings": False, "layer_types": ("mamba", "mamba", "full") * 2,
        "mamba_n_heads": 8, "mamba_head_dim": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
        "partial_rotary_factor": 0.5,
    },
}


def tiny_random_config(arch: str = "llama", **overrides: object) -> ModelConfig:
    """Config of the tiny test model; ``arch="qwen2"`` turns on q/k/v biases,
    ``arch="gemma3"`` / ``"bamba"`` are the tiny models of the module docstring."""
    fields = _TINY_ARCHS.get(arch) or {"num_layers": 2, "num_kv_heads": 2, "attention_bias": arch == "qwen2"}
    return ModelConfig(**{**_TINY_COMMON, **fields, "arch": arch, **overrides})  # type: ignore[arg-type]


def _tiny_bamba_state_dict(cfg: ModelConfig, randn: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    h, d, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    inner, cd, nh = cfg.mamba_inner, cfg.mamba_conv_dim, cfg.mamba_n_heads
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = 1.0 + randn(h)
        if cfg.layer_types[i] == "mamba":
            m = pre + "mamba."
            sd[m + "in_proj.weight"] = randn(inner + cd + nh, h)
            sd[m + "conv1d.weight"] = randn(cd, 1, cfg.mamba_d_conv)
            if cfg.mamba_conv_bias:
                sd[m + "conv1d.bias"] = randn(cd)
            sd[m + "dt_bias"] = randn(nh)
            sd[m + "A_log"] = torch.log(torch.arange(1, nh + 1, dtype=torch.float32)) + randn(nh)
            sd[m + "D"] = 1.0 + randn(nh)
            sd[m + "norm.weight"] = 1.0 + randn(inner)
            sd[m + "out_proj.weight"] = randn(h, inner)
        else:
            a = pre + "self_attn."
            sd[a + "q_proj.weight"] = randn(cfg.num_heads * d, h)
            sd[a + "k_proj.weight"] = randn(cfg.num_kv_heads * d, h)
            sd[a + "v_proj.weight"] = randn(cfg.num_kv_heads * d, h)
            sd[a + "o_proj.weight"] = randn(h, cfg.num_heads * d)
        sd[pre + "pre_ff_layernorm.weight"] = 1.0 + randn(h)
        sd[pre + "feed_forward.gate_proj.weight"] = randn(ff, h)
        sd[pre + "feed_forward.up_proj.weight"] = randn(ff, h)
        sd[pre + "feed_forward.down_proj.weight"] = randn(h, ff)
    sd["model.final_layernorm.weight"] = 1.0 + randn(h)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = randn(cfg.vocab_size, h)
    return sd


def tiny_random_state_dict(
    seed: int = 0, config: ModelConfig | None = None, std: float = 0.2
) -> dict[str, torch.Tensor]:
    """Float32 weights in Hugging Face naming, deterministic for a given seed and config."""
    cfg = config or tiny_random_config()
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    if cfg.arch == "bamba":
        return _tiny_bamba_state_dict(cfg, randn)
    gemma = cfg.arch == "gemma3"

    def norm(n: int) -> torch.Tensor:
        return randn(n) if gemma else 1.0 + randn(n)  # Gemma scales by 1 + w

    h, d = cfg.hidden_size, cfg.head_dim
    qs, kvs = cfg.num_heads * d, cfg.num_kv_heads * d
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = norm(h)
        sd[pre + "self_attn.q_proj.weight"] = randn(qs, h)
        sd[pre + "self_attn.k_proj.weight"] = randn(kvs, h)
        sd[pre + "self_attn.v_proj.weight"] = randn(kvs, h)
        if cfg.attention_bias:
            sd[pre + "self_attn.q_proj.bias"] = randn(qs)
            sd[pre + "self_attn.k_proj.bias"] = randn(kvs)
            sd[pre + "self_attn.v_proj.bias"] = randn(kvs)
        sd[pre + "self_attn.o_proj.weight"] = randn(h, qs)
        sd[pre + "post_attention_layernorm.weight"] = norm(h)
        sd[pre + "mlp.gate_proj.weight"] = randn(cfg.intermediate_size, h)
        sd[pre + "mlp.up_proj.weight"] = randn(cfg.intermediate_size, h)
        sd[pre + "mlp.down_proj.weight"] = randn(h, cfg.intermediate_size)
        if gemma:
            sd[pre + "self_attn.q_norm.weight"] = norm(d)
            sd[pre + "self_attn.k_norm.weight"] = norm(d)
            sd[pre + "pre_feedforward_layernorm.weight"] = norm(h)
            sd[pre + "post_feedforward_layernorm.weight"] = norm(h)
    sd["model.norm.weight"] = norm(h)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = randn(cfg.vocab_size, h)
    return sd
