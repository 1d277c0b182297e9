"""A seeded random tiny LLaVA written as a Hugging Face folder: real layout, meaningless weights.

The folder is what a user's LLaVA-1.5 folder holds (``config.json`` with model_type
``llava``, Hub-layout ``model.safetensors``, ``preprocessor_config.json`` for a
``CLIPImageProcessor``, ``tokenizer.json`` with an ``<image>`` token), so the ``tiny-random-llava``
alias loads through the same loader, and transformers' ``LlavaForConditionalGeneration``
can load the same folder as the reference in tests. It is written with torch, safetensors
and tokenizers only (transformers is a test dependency).

Default sizes: the decoder is the tiny random Llama (2 layers, hidden 64, GQA 4/2) with
an untied lm_head as in LLaVA and a vocabulary of 520 (the tiny byte-level tokenizer's 519
plus ``<image>``, id 519); the tower is a CLIP-ViT of 3 layers, hidden 32, 4 heads, on
30x30 images in 6x6 patches, read at its penultimate layer (``vision_feature_layer -2``,
CLS dropped): 25 image tokens per image. Weights use std 0.2 and LayerNorm weights
``1 + 0.2 * randn`` (non-zero biases too), as in :mod:`radixserve.model.testing.tiny`, so a loading
mistake changes the logits visibly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from radixserve.model.model_config import ModelConfig
from radixserve.model.vision.vlm_config import ClipVisionConfig

IMAGE_TOKEN = "<image>"
# Bumped whenever what write_tiny_llava writes changes: the cached folder is named by it.
TINY_LLAVA_VERSION = 1
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def tiny_llava_text_config(**overrides: Any) -> ModelConfig:
    """The decoder of the tiny LLaVA (the tiny random Llama, untied, vocabulary 520)."""
    from radixserve.model.testing.tiny import tiny_random_config

    return tiny_random_config(**{"vocab_size": 520, "tie_word_embeddings": False, **overrides})


def tiny_llava_vision_config(**overrides: Any) -> ClipVisionConfig:
    return ClipVisionConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_layers": 3, "num_heads": 4,
                               "image_size": 30, "patch_size": 6, **overrides})


def hf_config_dict(text: ModelConfig, vision: ClipVisionConfig, image_token_id: int,
                   feature_layer: int | list[int] = -2, select: str = "default") -> dict[str, Any]:
    """The ``config.json`` of a LLaVA with these parts (transformers v5 keys)."""
    tokens = vision.num_patches + (1 if select == "full" else 0)
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "image_token_index": image_token_id, "image_seq_length": tokens, "projector_hidden_act": "gelu",
        "vision_feature_layer": feature_layer, "vision_feature_select_strategy": select,
        "multimodal_projector_bias": True, "tie_word_embeddings": text.tie_word_embeddings,
        "text_config": {
            "model_type": "llama", "vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size, "num_hidden_layers": text.num_layers,
            "num_attention_heads": text.num_heads, "num_key_value_heads": text.num_kv_heads,
            "head_dim": text.head_dim, "rms_norm_eps": text.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta},
            "max_position_embeddings": text.max_position_embeddings,
            "tie_word_embeddings": text.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size, "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_heads, "num_channels": vision.num_channels,
            "image_size": vision.image_size, "patch_size": vision.patch_size, "hidden_act": vision.hidden_act,
            "layer_norm_eps": vision.layer_norm_eps, "projection_dim": vision.hidden_size,
        },
    }


def preprocessor_config_dict(image_size: int) -> dict[str, Any]:
    """A ``CLIPImageProcessor`` config for ``image_size`` squares (LLaVA-1.5's, scaled)."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True, "size": {"shortest_edge": image_size}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "do_convert_rgb": True,
    }


def tiny_llava_state_dict(text: ModelConfig, vision: ClipVisionConfig, seed: int = 0,
                          std: float = 0.2, num_feature_layers: int = 1) -> dict[str, torch.Tensor]:
    """Float32 weights in the Hub's LLaVA naming, deterministic for a seed and the configs."""
    from radixserve.model.testing.tiny import tiny_random_state_dict

    # model.* -> language_model.model.*, lm_head likewise
    sd = {"language_model." + k: v for k, v in tiny_random_state_dict(seed, text, std).items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    h, i, p = vision.hidden_size, vision.intermediate_size, vision.patch_size
    pre = "vision_tower.vision_model."
    sd[pre + "embeddings.patch_embedding.weight"] = randn(h, vision.num_channels, p, p)
    sd[pre + "embeddings.class_embedding"] = randn(h)
    sd[pre + "embeddings.position_embedding.weight"] = randn(vision.num_patches + 1, h)
    for name in ("pre_layrnorm", "post_layernorm"):
        sd[pre + name + ".weight"] = 1.0 + randn(h)
        sd[pre + name + ".bias"] = randn(h)
    for n in range(vision.num_layers):
        lp = f"{pre}encoder.layers.{n}."
        for ln in ("layer_norm1", "layer_norm2"):
            sd[lp + ln + ".weight"] = 1.0 + randn(h)
            sd[lp + ln + ".bias"] = randn(h)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            sd[lp + f"self_attn.{proj}.weight"] = randn(h, h)
            sd[lp + f"self_attn.{proj}.bias"] = randn(h)
        sd[lp + "mlp.fc1.weight"] = randn(i, h)
        sd[lp + "mlp.fc1.bias"] = randn(i)
        sd[lp + "mlp.fc2.weight"] = randn(h, i)
        sd[lp + "mlp.fc2.bias"] = randn(h)
    th = text.hidden_size
    sd["multi_modal_projector.linear_1.weight"] = randn(th, h * num_feature_layers)
    sd["multi_modal_projector.linear_1.bias"] = randn(th)
    sd["multi_modal_projector.linear_2.weight"] = randn(th, th)
    sd["multi_modal_projector.linear_2.bias"] = randn(th)
    return sd


def _write_tokenizer(path: Path, vocab_size: int) -> int:
    """tokenizer.json + tokenizer_config.json: the tiny byte-level BPE of ``vocab_size - 1``
    tokens plus ``<image>`` (the last id, returned)."""
    from tokenizers import AddedToken

    from radixserve.chat_template import CHATML_TEMPLATE
    from radixserve.model.testing.tiny_tokenizer import tiny_tokenizer

    backend = tiny_tokenizer(vocab_size - 1).backend
    backend.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_id = backend.token_to_id(IMAGE_TOKEN)
    if image_id != vocab_size - 1:
        raise ValueError(f"<image> got id {image_id}, expected {vocab_size - 1}")
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))
    return image_id


def write_tiny_llava(path: str | os.PathLike[str], seed: int = 0, text: ModelConfig | None = None,
                     vision: ClipVisionConfig | None = None, feature_layer: int | list[int] = -2,
                     select: str = "default") -> Path:
    """Write the LLaVA folder (see the module docstring) to ``path``; returns it. ``text`` /
    ``vision`` change the sizes (e.g. a small real VLM's for benchmarks); the image token is
    always the last id of the vocabulary."""
    from safetensors.torch import save_file

    text = text or tiny_llava_text_config()
    vision = vision or tiny_llava_vision_config()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    image_id = _write_tokenizer(out, text.vocab_size)
    n_layers = 1 if isinstance(feature_layer, int) else len(feature_layer)
    cfg = hf_config_dict(text, vision, image_id, feature_layer, select)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config_dict(vision.image_size), indent=2))
    sd = tiny_llava_state_dict(text, vision, seed, num_feature_layers=n_layers)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tiny_llava_dir() -> Path:
    """The ``tiny-random-llava`` folder in the model cache, written on first use (to a
    temporary folder renamed into place, so concurrent first uses never see half a folder)."""
    from radixserve.model.loaders.packages import model_cache_dir

    final = model_cache_dir() / f"tiny-random-llava-v{TINY_LLAVA_VERSION}"
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llava-", dir=final.parent))
    try:
        write_tiny_llava(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race: its folder is the same
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
