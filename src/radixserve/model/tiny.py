"""A seeded random tiny Llama for fast tests: real architecture, meaningless weights.

Sized so that a full forward takes milliseconds on a CPU but every structural feature is
exercised: 2 layers (layer indexing), GQA (4 query heads over 2 KV heads), tied embeddings.
Weights use std 0.2 and the norm weights are ``1 + 0.2 * randn`` rather than ones, so a
loading mistake (a swapped or missing norm, a transposed projection) changes the logits
visibly instead of hiding behind identity-like weights.
"""

from __future__ import annotations

import torch

from radixserve.model.config import ModelConfig


def tiny_random_config(arch: str = "llama", **overrides: object) -> ModelConfig:
    """Config of the tiny test model; ``arch="qwen2"`` turns on q/k/v biases."""
    fields: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=arch == "qwen2",
        arch=arch,
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def tiny_random_state_dict(
    seed: int = 0, config: ModelConfig | None = None, std: float = 0.2
) -> dict[str, torch.Tensor]:
    """Float32 weights in Hugging Face naming, deterministic for a given seed and config."""
    cfg = config or tiny_random_config()
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + randn(n)

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
    sd["model.norm.weight"] = norm(h)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = randn(cfg.vocab_size, h)
    return sd
