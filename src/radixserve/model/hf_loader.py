"""Load a Hugging Face model folder: ``config.json`` + ``*.safetensors`` + ``tokenizer.json``.

Only the Llama family is supported (``LlamaForCausalLM``, ``Qwen2ForCausalLM``): those are the
architectures our ``model/llama.py`` implements. The weights are already in HF naming and
rotate-half q/k layout, so this loader only reads, filters and checks them. transformers is
deliberately not imported: it is a test-only dependency.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.errors import ModelLoadError
from radixserve.model.tokenizer import Tokenizer, read_json_object

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2"}


@dataclass
class HFModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # as stored (e.g. bfloat16); HF names
    tokenizer: Tokenizer | None
    name: str


def _read_config_json(path: str) -> dict[str, Any]:
    cfg = read_json_object(os.path.join(path, "config.json"))
    if cfg is None:
        raise ModelLoadError(path, "not a Hugging Face model folder (no config.json)")
    return cfg


def config_from_hf(cfg: dict[str, Any], path: str = "config.json") -> ModelConfig:
    """Map a transformers ``config.json`` dict (v4 or v5 layout) to :class:`ModelConfig`."""
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(
            path,
            f"unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(ARCHITECTURES)})",
        )
    if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ModelLoadError(path, "Llama with attention_bias/mlp_bias is not supported")

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
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",
            arch=arch,
            rope_scaling=dict(scaling) if scaling else None,
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid config.json ({e})") from e


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
    cfg = _read_config_json(path)
    config = config_from_hf(cfg, os.path.join(path, "config.json"))
    state_dict: dict[str, torch.Tensor] = {}
    for fn in _safetensors_files(path):
        try:
            part = load_file(fn)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(fn, f"corrupted or truncated safetensors file ({e})") from e
        state_dict.update(part)
    # Buffers some exports carry that are recomputed, not learned.
    for k in [k for k in state_dict if k.endswith("rotary_emb.inv_freq")]:
        del state_dict[k]
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state_dict:
        raise ModelLoadError(path, "untied model (tie_word_embeddings=false) without lm_head.weight")
    tokenizer = Tokenizer.from_hf_dir(path) if with_tokenizer else None
    name = os.path.basename(os.path.normpath(path))
    return HFModel(config=config, state_dict=state_dict, tokenizer=tokenizer, name=name)
