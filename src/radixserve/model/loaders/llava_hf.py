"""Read a Hugging Face LLaVA folder (model_type ``llava``): config, split weights, processor.

A ``LlavaForConditionalGeneration`` folder's ``config.json`` nests a ``text_config`` (a Llama
or Qwen2 decoder) and a ``vision_config`` (``clip_vision_model``), each listing only what
differs from transformers' defaults, which are filled in here. Its weights come in three
layouts, all accepted: the Hub's (``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``), what transformers v5 saves
(``vision_tower.*`` without ``vision_model``), and v5's module names (``model.language_model.*``,
``model.vision_tower.*``, ``lm_head.*``). The decoder's tensors are renamed to the text
model's names (``model.*``, ``lm_head.weight``) and checked like any text model; the tower's
to ``vision_tower.vision_model.*`` and the projector's to ``multi_modal_projector.*``.
``preprocessor_config.json`` gives the image preprocessing. transformers is not imported.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from radixserve.model.load_error import ModelLoadError
from radixserve.model.tokenization.tokenizer import read_json_object
from radixserve.model.vision.vlm_config import ClipVisionConfig, ImageProcessorConfig, VisionLanguageConfig

# transformers' LlamaConfig defaults (a LLaVA text_config lists only what differs).
LLAMA_DEFAULTS: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
# CLIPVisionConfig defaults, and what LlavaConfig puts in place of a missing vision_config.
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
LLAVA_VISION_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 336,
    "num_hidden_layers": 24, "num_attention_heads": 16,
}
TEXT_MODEL_TYPES = ("llama", "qwen2")
PROCESSOR_TYPES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil",
                   "LlavaImageProcessor", "LlavaImageProcessorFast", "LlavaImageProcessorPil")

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.",
                    "vision_tower.vision_model.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def is_llava(cfg: dict[str, Any]) -> bool:
    """Whether a ``config.json`` dict describes a LLaVA model."""
    return cfg.get("model_type") == "llava" or "LlavaForConditionalGeneration" in (cfg.get("architectures") or [])


def text_hf_config(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The decoder's ``config.json`` dict, transformers' Llama defaults filled in."""
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ModelLoadError(path, "a llava config.json's text_config must be an object")
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_MODEL_TYPES:
        raise ModelLoadError(path, f"unsupported LLaVA text_config.model_type {model_type!r} "
                                   f"(supported: {', '.join(TEXT_MODEL_TYPES)})")
    base = LLAMA_DEFAULTS if model_type == "llama" else {"model_type": model_type}
    out = {**base, **{k: v for k, v in text.items() if v is not None}}
    out.pop("architectures", None)  # the model_type says which decoder
    # LlavaConfig ties when either level asks to.
    out["tie_word_embeddings"] = bool(out.get("tie_word_embeddings")) or bool(cfg.get("tie_word_embeddings"))
    return out


def vision_config_from_hf(cfg: dict[str, Any], path: str) -> ClipVisionConfig:
    v = cfg.get("vision_config")
    if v is None:
        v = {"model_type": "clip_vision_model", **LLAVA_VISION_DEFAULTS}
    if not isinstance(v, dict):
        raise ModelLoadError(path, "a llava config.json's vision_config must be an object")
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelLoadError(path, f"unsupported vision_config.model_type {v.get('model_type')!r} "
                                   "(supported: clip_vision_model)")
    v = {**CLIP_VISION_DEFAULTS, **{k: x for k, x in v.items() if x is not None}}
    for key in ("image_size", "patch_size"):
        if isinstance(v[key], (list, tuple)):
            if len(set(v[key])) != 1:
                raise ModelLoadError(path, f"non-square vision_config.{key} {v[key]!r} is not supported")
            v[key] = v[key][0]
    try:
        return ClipVisionConfig(
            hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
            num_channels=int(v["num_channels"]), image_size=int(v["image_size"]),
            patch_size=int(v["patch_size"]), hidden_act=str(v["hidden_act"]),
            layer_norm_eps=float(v["layer_norm_eps"]),
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid vision_config ({e})") from e


def vlm_config_from_hf(cfg: dict[str, Any], text: Any, path: str) -> VisionLanguageConfig:
    """The :class:`VisionLanguageConfig` of a llava ``config.json`` whose decoder config
    (:func:`radixserve.model.loaders.hf_loader.config_from_hf` of :func:`text_hf_config`) is ``text``."""
    vision = vision_config_from_hf(cfg, path)
    layers = cfg.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else layers
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise ModelLoadError(path, f"vision_feature_layer must be an int or a list of ints, got {layers!r}")
    n = vision.num_layers
    # transformers indexes a tuple of num_layers + 1 hidden states (embeddings first).
    if any(not -(n + 1) <= i <= n for i in layers):
        raise ModelLoadError(path, f"vision_feature_layer {layers!r} outside the {n + 1} hidden states")
    token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
    try:
        out = VisionLanguageConfig(
            text=text, vision=vision, image_token_id=int(token),
            feature_layers=tuple(i % (n + 1) for i in layers),
            feature_select=str(cfg.get("vision_feature_select_strategy", "default")),
            projector_act=str(cfg.get("projector_hidden_act", "gelu")),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid config.json ({e})") from e
    # The processor expands each <image> into image_seq_length tokens: it must be what the
    # tower produces, or prompts and features would not line up.
    seq = cfg.get("image_seq_length")
    if seq is not None and seq != out.tokens_per_image:
        raise ModelLoadError(path, f"image_seq_length is {seq}, but the vision tower gives "
                                   f"{out.tokens_per_image} tokens per image")
    return out


def processor_config_from_dir(path: str) -> ImageProcessorConfig:
    """The image preprocessing of a folder's ``preprocessor_config.json``."""
    fn = os.path.join(path, "preprocessor_config.json")
    d = read_json_object(fn)
    if d is None:
        raise ModelLoadError(fn, "missing preprocessor_config.json (a LLaVA folder needs its image processor)")
    kind = d.get("image_processor_type", "CLIPImageProcessor")
    if kind not in PROCESSOR_TYPES:
        raise ModelLoadError(fn, f"unsupported image_processor_type {kind!r} (supported: {', '.join(PROCESSOR_TYPES)})")
    try:
        return ImageProcessorConfig.from_hf(d)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(fn, f"invalid preprocessor config ({e})") from e


Tensors = dict[str, torch.Tensor]


def split_weights(state_dict: Tensors, path: str) -> tuple[Tensors, Tensors]:
    """(decoder tensors under text-model names, tower + projector tensors under
    ``vision_tower.vision_model.*`` / ``multi_modal_projector.*``); ModelLoadError on a
    tensor that belongs to none of them."""
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        v = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
        if v is not None:
            vision["vision_tower.vision_model." + name[len(v):]] = t
            continue
        p = next((p for p in _PROJECTOR_PREFIXES if name.startswith(p)), None)
        if p is not None:
            vision["multi_modal_projector." + name[len(p):]] = t
            continue
        m = next(((old, new) for old, new in _TEXT_PREFIXES if name.startswith(old)), None)
        if m is None:
            raise ModelLoadError(path, f"unexpected tensor {name!r} in a LLaVA checkpoint")
        text[m[1] + name[len(m[0]):]] = t
    return text, vision
