"""A LLaVA-style vision-language model: CLIP-ViT tower -> projector -> the Llama decoder.

Checked against transformers' ``LlavaForConditionalGeneration``:

* :meth:`LlavaForConditionalGeneration.encode_images`: the tower's hidden states at
  ``feature_layers`` (concatenated), the CLS position dropped under the "default" strategy,
  then the projector ``linear_2(act(linear_1(x)))``: ``tokens_per_image`` rows per image in
  the decoder's hidden size.
* The prompt holds ``tokens_per_image`` placeholder tokens (``image_token_id``) per image
  (:func:`expand_image_tokens` turns one placeholder per image into that many). Their
  embeddings are replaced, in order, by the image features rounded to the decoder's dtype
  (:func:`merge_image_features`); the decoder then runs on those embeddings through
  :attr:`ForwardBatch.input_embeds`, at the ordinary positions, over the same KV pool.

Everything the KV cache and scheduler see is the decoder: ``model.config`` is its
:class:`ModelConfig`, and a batch without images runs exactly as the text model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.vision.clip import ClipVisionTower, activation
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput
from radixserve.model.arch.layers import EmptyParams
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.loaders.hf_weights import HFWeights
from radixserve.model.vision.vlm_config import VisionLanguageConfig

PROJECTOR_PREFIX = "multi_modal_projector."


def expand_image_tokens(token_ids: Sequence[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """Each image placeholder in ``token_ids`` repeated ``tokens_per_image`` times (what
    transformers' LlavaProcessor does to the text before tokenising)."""
    out: list[int] = []
    for t in token_ids:
        if t == image_token_id:
            out.extend([image_token_id] * tokens_per_image)
        else:
            out.append(t)
    return out


def merge_image_features(embeds: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                         features: torch.Tensor | None) -> torch.Tensor:
    """``embeds`` [T, H] with the rows at placeholder tokens replaced, in order, by the rows of
    ``features`` [K, H] (cast to ``embeds``' dtype); ValueError unless K equals the number of
    placeholders."""
    mask = input_ids == image_token_id
    n = int(mask.sum())
    k = 0 if features is None else features.shape[0]
    if n != k:
        raise ValueError(f"the tokens hold {n} image placeholder tokens but {k} image feature rows "
                         "were given")
    if n == 0:
        return embeds
    assert features is not None
    if features.dim() != 2 or features.shape[1] != embeds.shape[1]:
        raise ValueError(f"image features must be [K, {embeds.shape[1]}], got {list(features.shape)}")
    out = embeds.clone()
    out[mask] = features.to(device=embeds.device, dtype=embeds.dtype)
    return out


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))`` from the tower's width (times feature layers) to the
    decoder's hidden size."""

    def __init__(self, config: VisionLanguageConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, vin = config.text.hidden_size, config.projector_in
        self.act = config.projector_act
        self.dtype = dtype

        p = EmptyParams(dtype, device)
        self.w1, self.w2 = p(h, vin), p(h, h)
        self.b1 = p(h) if config.projector_bias else None
        self.b2 = p(h) if config.projector_bias else None

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], used: set[str]) -> None:
        weights = HFWeights(state_dict, self.w1.device, used)
        for name, param in (("linear_1.weight", self.w1), ("linear_2.weight", self.w2),
                            ("linear_1.bias", self.b1), ("linear_2.bias", self.b2)):
            if param is not None:
                weights.put(param, weights.get(PROJECTOR_PREFIX + name, tuple(param.shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """float32 [..., hidden] of float32 features [..., projector_in]."""
        y = activation(self.act, F.linear(x.to(self.dtype), self.w1, self.b1))
        return F.linear(y, self.w2, self.b2).float()


class LlavaForConditionalGeneration(nn.Module):
    """Vision tower + projector + :class:`LlamaForCausalLM` (see the module docstring)."""

    def __init__(self, vlm_config: VisionLanguageConfig, language_model: LlamaForCausalLM,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        if language_model.config != vlm_config.text:
            raise ValueError("language_model.config differs from vlm_config.text")
        self.vlm_config = vlm_config
        self.language_model = language_model
        self.device = torch.device(device)
        self.vision_tower = ClipVisionTower(vlm_config.vision, vlm_config.encoder_layers_used, dtype, self.device)
        self.projector = LlavaProjector(vlm_config, dtype, self.device)

    @property
    def config(self) -> ModelConfig:
        """The decoder's config: what the KV pool and the scheduler size things by."""
        return self.language_model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.dtype

    @classmethod
    def from_state_dicts(cls, vlm_config: VisionLanguageConfig, text_state_dict: Mapping[str, torch.Tensor],
                         vision_state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", **lm_kwargs: Any) -> "LlavaForConditionalGeneration":
        """Build from the decoder's HF-named weights (``model.*``, ``lm_head.weight``) and the
        vision side's (``vision_tower.vision_model.*``, ``multi_modal_projector.*``); strict
        about names and shapes on both. ``lm_kwargs`` go to
        :meth:`LlamaForCausalLM.from_state_dict` (pack_weights, cpu_isa, linear_backend)."""
        lm = LlamaForCausalLM.from_state_dict(vlm_config.text, text_state_dict, dtype=dtype, device=device,
                                              **lm_kwargs)  # Llama / Qwen2 only: check_config says so
        model = cls(vlm_config, lm, dtype=dtype, device=device)
        used: set[str] = set()
        model.vision_tower.load_hf_state_dict(vision_state_dict, used)
        model.projector.load_hf_state_dict(vision_state_dict, used)
        unexpected = [k for k in vision_state_dict if k not in used]
        if unexpected:
            raise ValueError(f"vision state dict has {len(unexpected)} unexpected keys, e.g. {unexpected[:5]}")
        return model

    # ------------------------------------------------------------------ images
    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """float32 [N, tokens_per_image, hidden]: each image's projected features."""
        cfg = self.vlm_config
        states = self.vision_tower(pixel_values, cfg.feature_layers)
        if cfg.feature_select == "default":
            states = [s[:, 1:] for s in states]
        return self.projector(torch.cat(states, dim=-1))

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        """float32 [T, hidden] input embeddings: the token embeddings with each placeholder
        row replaced by the next image feature row (rounded to the decoder's dtype, as
        transformers does). ``image_features``: [K, hidden], or [N, tokens_per_image, hidden]
        as :meth:`encode_images` returns it."""
        lm = self.language_model
        emb = lm.embed_tokens(input_ids.to(lm.device))
        if image_features is not None and image_features.dim() == 3:
            image_features = image_features.reshape(-1, image_features.shape[-1])
        merged = merge_image_features(emb, input_ids, self.vlm_config.image_token_id, image_features)
        return merged.to(torch.float32)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend,  # type: ignore[override]
                image_features: torch.Tensor | None = None) -> ForwardOutput:
        """The decoder over ``batch``, with the batch's placeholder tokens (all sequences, in
        batch order) taking the rows of ``image_features``; without placeholders and
        features, exactly the text model's forward."""
        if image_features is None and not bool((batch.input_ids == self.vlm_config.image_token_id).any()):
            return self.language_model(batch, kv_pool, attn)
        embeds = self.embed(batch.input_ids, image_features)
        return self.language_model(dataclasses.replace(batch, input_embeds=embeds), kv_pool, attn)
