"""Load a Hugging Face model folder: ``config.json`` + ``*.safetensors`` + ``tokenizer.json``.

Supported: the Llama family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``; ``model/arch/llama.py``),
Bamba (``BambaForCausalLM``: Mamba2 and attention layers; ``model/arch/bamba.py``) and Gemma 3's
text model (``Gemma3ForCausalLM``, model_type ``gemma3_text``; and the text
part of a multimodal ``Gemma3ForConditionalGeneration`` folder, model_type ``gemma3`` with a
``text_config``, whose vision tower is dropped; ``model/arch/gemma3.py``); LLaVA folders
(``LlavaForConditionalGeneration``: the Llama decoder, plus the vision tower, projector and
image preprocessing as :class:`VisionParts`; ``model/loaders/llava_hf.py``). The weights are already
in HF naming and rotate-half q/k layout, so this loader only reads, filters and checks them.
transformers is deliberately not imported: it is a test-only dependency.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.model.model_config import ModelConfig
from radixserve.model.load_error import ModelLoadError
from radixserve.model.loaders.llava_hf import (is_llava, processor_config_from_dir, split_weights, text_hf_config,
                                       vlm_config_from_hf)
from radixserve.model.tokenization.tokenizer import Tokenizer, read_json_object
from radixserve.model.vision.vlm_config import VisionParts

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
                 "LlavaForConditionalGeneration": "llava", "BambaForCausalLM": "bamba"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3",
               "llava": "llava", "bamba": "bamba"}

# transformers' BambaConfig defaults, for keys a config.json leaves out.
BAMBA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128_000, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 262_144, "attn_layer_indices": None, "mamba_n_heads": 128,
    "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": (0.0, float("inf")),
    "attention_bias": False, "mlp_bias": False,
}

# transformers' Gemma3TextConfig defaults: a multimodal folder's text_config lists only what
# differs from them.
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6,
}
GEMMA3_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


@dataclass
class HFModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # as stored (e.g. bfloat16); HF names
    tokenizer: Tokenizer | None
    name: str
    vision: VisionParts | None = None  # a LLaVA folder's tower, projector and preprocessing


def config_from_hf(cfg: dict[str, Any], path: str = "config.json") -> ModelConfig:
    """Map a transformers ``config.json`` dict (v4 or v5 layout) to :class:`ModelConfig`."""
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(path, f"unsupported architecture {archs or cfg.get('model_type')!r} "
                                   f"(supported: {', '.join(ARCHITECTURES)})")
    if arch == "llava":  # the decoder of a vision-language folder (model/loaders/llava_hf.py)
        return config_from_hf(text_hf_config(cfg, path), path)
    if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ModelLoadError(path, "Llama with attention_bias/mlp_bias is not supported")
    if arch == "gemma3":
        return _gemma3_config(cfg, path)
    if arch == "bamba":
        return _bamba_config(cfg, path)

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelLoadError(path, f"config.json lacks {key!r}")
        return cfg[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # transformers v5 moved rope_theta/rope_scaling into "rope_parameters".
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    try:
        return ModelConfig(
            vocab_size=int(need("vocab_size")), hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=arch == "qwen2",
            arch=arch, rope_scaling=dict(scaling) if scaling else None,
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid config.json ({e})") from e


def _json_float(v: Any) -> float:
    """A float of config.json: a number, or a non-finite one as transformers writes it
    (``{"__float__": "Infinity"}``) or as a string."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


def _bamba_config(cfg: dict[str, Any], path: str) -> ModelConfig:
    """Bamba's config (transformers v4 or v5 layout; missing keys at transformers' defaults).
    transformers rotates half of each attention head whatever the file says (it hard-codes
    ``partial_rotary_factor`` 0.5), so that is what is served."""
    cfg = {**BAMBA_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias"):
        if cfg.get(key):
            raise ModelLoadError(path, f"Bamba with {key}=true is not supported")
    n = int(cfg["num_hidden_layers"])
    attn = set(cfg.get("attn_layer_indices") or ())
    if any(not isinstance(i, int) or not 0 <= i < n for i in attn):
        raise ModelLoadError(path, f"attn_layer_indices must be layer indices in [0, {n}), got {sorted(attn)}")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    m_heads = int(cfg["mamba_n_heads"])
    m_inner = int(cfg["mamba_expand"]) * hidden
    m_head_dim = m_inner // m_heads if cfg["mamba_d_head"] == "auto" else int(cfg["mamba_d_head"])
    if m_head_dim * m_heads != m_inner:
        raise ModelLoadError(path, f"mamba_d_head ({m_head_dim}) x mamba_n_heads ({m_heads}) must equal "
                                   f"mamba_expand x hidden_size ({m_inner})")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ModelLoadError(path, "Bamba with RoPE scaling is not supported")
    limit = cfg["time_step_limit"]
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=n, num_heads=heads, num_kv_heads=int(cfg["num_key_value_heads"] or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]), arch="bamba",
            layer_types=tuple("full" if i in attn else "mamba" for i in range(n)), hidden_act=str(cfg["hidden_act"]),
            mamba_n_heads=m_heads, mamba_head_dim=m_head_dim, mamba_n_groups=int(cfg["mamba_n_groups"]),
            mamba_d_state=int(cfg["mamba_d_state"]), mamba_d_conv=int(cfg["mamba_d_conv"]),
            mamba_conv_bias=bool(cfg["mamba_conv_bias"]),
            mamba_dt_limit=(_json_float(limit[0]), _json_float(limit[1])), partial_rotary_factor=0.5,
        )
    except (ValueError, TypeError, IndexError) as e:
        raise ModelLoadError(path, f"invalid config.json ({e})") from e


def _gemma3_config(cfg: dict[str, Any], path: str) -> ModelConfig:
    """Gemma 3's text config (``gemma3_text``, or the ``text_config`` of a ``gemma3`` folder),
    transformers v4 or v5 layout, missing keys at transformers' defaults."""
    top = cfg
    if cfg.get("model_type") == "gemma3" or "text_config" in cfg:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(path, "a gemma3 config.json needs a text_config object")
        cfg = dict(text)
        cfg.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", True))
    cfg = {**GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(path, "attn_logit_softcapping is not supported (Gemma 2 style attention "
                                   "softcapping; the attention kernels do not implement it)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(path, "use_bidirectional_attention is not supported (causal LMs only)")
    n = int(cfg["num_hidden_layers"])
    names = _gemma3_layer_types(cfg, n, path)
    theta, local_theta, scaling = _gemma3_rope(cfg, path)
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=n, num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]), rope_theta=theta,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]), attention_bias=bool(cfg.get("attention_bias", False)),
            arch="gemma3", rope_scaling=scaling, sliding_window=int(cfg["sliding_window"]),
            layer_types=tuple(GEMMA3_LAYER_TYPES[t] for t in names), rope_local_theta=local_theta,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act")),
            final_logit_softcapping=(None if cfg.get("final_logit_softcapping") is None
                                     else float(cfg["final_logit_softcapping"])),
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid config.json ({e})") from e


def _gemma3_layer_types(cfg: dict[str, Any], n: int, path: str) -> list[str]:
    """Each layer's HF attention kind: ``layer_types``, or the older integer pattern (every
    pattern-th layer global); ModelLoadError for a kind we do not run."""
    names = cfg.get("layer_types")
    if names is None:
        pattern = int(cfg["sliding_window_pattern"])
        names = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    bad = [t for t in names if t not in GEMMA3_LAYER_TYPES]
    if bad:
        raise ModelLoadError(path, f"unsupported layer type {bad[0]!r} (supported: {', '.join(GEMMA3_LAYER_TYPES)})")
    return names


def _gemma3_rope(cfg: dict[str, Any], path: str) -> tuple[float, float, dict[str, Any] | None]:
    """(global theta, local theta, the global layers' scaling or None). transformers v5 nests
    them per layer type under rope_parameters; v4 has rope_theta, rope_local_base_freq and
    rope_scaling (which applies to the full-attention layers)."""
    rope = cfg.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    theta = float(full.pop("rope_theta", cfg["rope_theta"]))
    local_theta = float(local.pop("rope_theta", cfg["rope_local_base_freq"]))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(path, f"RoPE scaling on the sliding-window layers ({local}) is not supported")
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    return theta, local_theta, scaling


# Where a multimodal Gemma 3 folder keeps its text model (transformers v5 and v4 names), and
# what else it holds.
_GEMMA3_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."))
_GEMMA3_OTHER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                          "multi_modal_projector.")


def _gemma3_text_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors under Gemma3ForCausalLM names (vision tower dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.startswith(_GEMMA3_OTHER_PREFIXES):
            continue
        for old, new in _GEMMA3_TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = t
    return out


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(index, f"cannot parse the shard index ({e})") from e
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(path, fn)):
                raise ModelLoadError(os.path.join(path, fn), "shard listed in the index is missing")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise ModelLoadError(path, "no *.safetensors weights (PyTorch .bin is not supported)")
    return [os.path.join(path, f) for f in found]


def load_hf_dir(path: str | os.PathLike[str], *, with_tokenizer: bool = True) -> HFModel:
    """Read config, weights and tokenizer of an HF folder (see module docstring)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "folder not found")
    cfg = read_json_object(os.path.join(path, "config.json"))
    if cfg is None:
        raise ModelLoadError(path, "not a Hugging Face model folder (no config.json)")
    config = config_from_hf(cfg, os.path.join(path, "config.json"))
    state_dict: dict[str, torch.Tensor] = {}
    for fn in _safetensors_files(path):
        try:
            part = load_file(fn)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(fn, f"corrupted or truncated safetensors file ({e})") from e
        state_dict.update(part)
    if config.arch == "gemma3":
        state_dict = _gemma3_text_weights(state_dict)
    vision = None
    if is_llava(cfg):
        state_dict, vision = _llava_parts(cfg, config, state_dict, path)
    # Buffers some exports carry that are recomputed, not learned.
    for k in [k for k in state_dict if k.endswith("rotary_emb.inv_freq")]:
        del state_dict[k]
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state_dict:
        raise ModelLoadError(path, "untied model (tie_word_embeddings=false) without lm_head.weight")
    tokenizer = Tokenizer.from_hf_dir(path) if with_tokenizer else None
    name = os.path.basename(os.path.normpath(path))
    return HFModel(config=config, state_dict=state_dict, tokenizer=tokenizer, name=name, vision=vision)


def _llava_parts(cfg: dict[str, Any], config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 path: str) -> tuple[dict[str, torch.Tensor], VisionParts]:
    """A LLaVA folder's decoder weights (text-model names) and its vision side."""
    text, vision = split_weights(state_dict, path)
    parts = VisionParts(config=vlm_config_from_hf(cfg, config, os.path.join(path, "config.json")),
                        state_dict=vision, processor=processor_config_from_dir(path))
    return text, parts
