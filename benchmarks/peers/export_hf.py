"""Export the SmolLM2 weights radixserve serves (dequantised from the bundled GGUF) as a
Hugging Face folder (config.json, model.safetensors in bfloat16, tokenizer.json,
tokenizer_config.json) for peers that need HF weights (vLLM).

    python benchmarks/peers/export_hf.py /tmp/peers/smollm2-bf16
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

from radixserve.model.registry import load_model


def main(out: str = "/tmp/peers/smollm2-bf16", dtype: str = "bfloat16") -> None:
    os.makedirs(out, exist_ok=True)
    m = load_model("smollm2-135m", dtype=torch.float32)
    c = m.config
    tdt = getattr(torch, dtype)
    sd = {k: v.to(tdt).contiguous() for k, v in m.state_dict.items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok = m.tokenizer
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu", "initializer_range": 0.02,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.eos_token_id, "torch_dtype": dtype, "use_cache": True,
    }
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
    json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id},
              open(os.path.join(out, "generation_config.json"), "w"), indent=2)
    tok.backend.save(os.path.join(out, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
               "eos_token": tok.eos_token, "pad_token": tok.eos_token,
               "unk_token": tok.eos_token, "add_bos_token": bool(tok.add_bos_token),
               "model_max_length": c.max_position_embeddings,
               "chat_template": tok.chat_template},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    print(f"wrote {out}: {len(sd)} tensors ({dtype})")


if __name__ == "__main__":
    main(*sys.argv[1:])
