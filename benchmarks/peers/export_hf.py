"""Export the weights radixserve serves (dequantised from the bundled GGUF) as a Hugging Face
folder (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) for peers that need HF weights (vLLM).

    python benchmarks/peers/export_hf.py /opt/peers/smollm2-bf16                  # SmolLM2, bf16
    python benchmarks/peers/export_hf.py /opt/peers/smollm2-f32 float32
    python benchmarks/peers/export_hf.py --model gemma3 /opt/peers/gemma3-bf16    # Gemma 3 270M
    python benchmarks/peers/export_hf.py --model gemma3 /opt/peers/gemma3-f32 float32

Models: ``smollm2`` (SmolLM2-135M-Instruct Q4_1, as ``LlamaForCausalLM``) and ``gemma3``
(google/gemma-3-270m base, Q4_K_M, as a text-only ``Gemma3ForCausalLM`` / ``gemma3_text``).
The tensors are radixserve's own ``load_model`` state dict (HF names and layout: the loader
undoes llama.cpp's q/k permutation and Gemma's stored ``1 + w`` norms), cast to DTYPE
(``bfloat16`` by default, or ``float32``: the weights radixserve's ``--dtype float32`` runs).
The tokenizer is radixserve's, built from the GGUF; for Gemma 3 its tokenizer.json gets a
post-processor that puts ``<bos>`` first, so a raw completion prompt starts with BOS in vLLM as
it does in radixserve (``encode_prompt``) and llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os

import tokenizers
import torch
from safetensors.torch import save_file

from radixserve.model.registry import load_model

MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def _llama_config(c, tok, dtype: str) -> dict:
    return {
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


def _gemma3_config(c, tok, dtype: str) -> dict:
    """transformers 5's ``Gemma3TextConfig`` (model_type ``gemma3_text``), which vLLM loads as
    ``Gemma3ForCausalLM``: RoPE per layer type in ``rope_parameters`` (full layers at
    ``rope_theta``, sliding ones at ``rope_local_theta``), the sliding window, and every layer's
    type as radixserve runs it."""
    if c.rope_scaling:
        raise SystemExit(f"gemma3 export: rope_scaling {c.rope_scaling} not handled")
    pad = tok.backend.token_to_id("<pad>")
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_activation": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
        },
        "query_pre_attn_scalar": int(c.query_pre_attn_scalar or c.head_dim),
        "sliding_window": c.sliding_window or None,
        "layer_types": [f"{t}_attention" for t in c.layer_types] or None,
        "final_logit_softcapping": c.final_logit_softcapping, "attn_logit_softcapping": None,
        "attention_bias": c.attention_bias, "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_word_embeddings, "initializer_range": 0.02,
        "use_bidirectional_attention": False,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": pad if pad is not None else 0, "torch_dtype": dtype, "use_cache": True,
        # the config format (rope_parameters) is transformers 5's; without a version, its
        # tokenizer loader takes the folder for an old Mistral one and warns "incorrect regex"
        "transformers_version": "5.0.0",
    }


def export(out: str, dtype: str = "bfloat16", model: str = "smollm2") -> None:
    os.makedirs(out, exist_ok=True)
    m = load_model(MODELS[model], dtype=torch.float32)
    c = m.config
    tdt = getattr(torch, dtype)
    sd = {k: v.to(tdt).contiguous() for k, v in m.state_dict.items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok = m.tokenizer
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())  # a copy: radixserve's stays as is
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": None,
               "model_max_length": c.max_position_embeddings}
    if not tok.chat_template_builtin:
        # Only the model's own: the base Gemma 3 ships none, and a stand-in written here
        # would pass for its own in every server that loads the folder.
        tok_cfg["chat_template"] = tok.chat_template
    if model == "gemma3":
        config = _gemma3_config(c, tok, dtype)
        bos = backend.id_to_token(tok.bos_token_id)
        if tok.prompt_bos and backend.post_processor is None:
            backend.post_processor = tokenizers.processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
        eos_ids = sorted(tok.stop_token_ids)  # <eos> and <end_of_turn>, as radixserve stops
        tok_cfg |= {"bos_token": bos, "eos_token": backend.id_to_token(tok.eos_token_id),
                    "pad_token": backend.id_to_token(config["pad_token_id"]),
                    "unk_token": "<unk>" if backend.token_to_id("<unk>") is not None else None,
                    "add_bos_token": bool(tok.prompt_bos), "add_eos_token": False}
        gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": eos_ids,
               "pad_token_id": config["pad_token_id"]}
    else:
        config = _llama_config(c, tok, dtype)
        tok_cfg |= {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.eos_token,
                    "unk_token": tok.eos_token, "add_bos_token": bool(tok.add_bos_token)}
        gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
    json.dump(gen, open(os.path.join(out, "generation_config.json"), "w"), indent=2)
    backend.save(os.path.join(out, "tokenizer.json"))
    json.dump(tok_cfg, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    print(f"wrote {out}: {MODELS[model]}, {len(sd)} tensors ({dtype})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="output folder (default /opt/peers/MODEL-bf16 or -f32)")
    ap.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    args = ap.parse_args()
    peers = os.environ.get("PEERS_DIR", "/opt/peers")
    out = args.out or os.path.join(peers, f"{args.model}-{'f32' if args.dtype == 'float32' else 'bf16'}")
    export(out, args.dtype, args.model)


if __name__ == "__main__":
    main()
