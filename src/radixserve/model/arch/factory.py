"""Which model class runs a config, and building it: ``create_model(config, state_dict)``
(``create_vlm`` for a vision-language model: the same decoder plus its vision side).

The engine, the model runner and the tensor-parallel workers build their model here, so a
new architecture is one entry in :func:`model_class`. The model modules are imported on
use: loading a tokenizer or a config never pulls them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from radixserve.model.model_config import ModelConfig

if TYPE_CHECKING:
    from radixserve.model.arch.llama import LlamaForCausalLM
    from radixserve.model.arch.llava import LlavaForConditionalGeneration
    from radixserve.model.vision.vlm_config import VisionParts


def model_class(config: ModelConfig) -> "type[LlamaForCausalLM]":
    """The class implementing ``config.arch``: Llama / Qwen2, Gemma 3, or Bamba."""
    if config.arch == "bamba":
        from radixserve.model.arch.bamba import BambaForCausalLM

        return BambaForCausalLM
    if config.arch == "gemma3":
        from radixserve.model.arch.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from radixserve.model.arch.llama import LlamaForCausalLM

    return LlamaForCausalLM


def create_model(config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                 **kwargs: Any) -> "LlamaForCausalLM":
    """The model for ``config`` with ``state_dict``'s weights (Hugging Face naming); the
    keyword arguments are those of :meth:`LlamaForCausalLM.from_state_dict` (dtype, device,
    pack_weights, cpu_isa, linear_backend)."""
    return model_class(config).from_state_dict(config, state_dict, **kwargs)


def create_vlm(config: ModelConfig, state_dict: Mapping[str, torch.Tensor], vision: "VisionParts",
               **kwargs: Any) -> "LlavaForConditionalGeneration":
    """The vision-language model of a loaded VLM (``LoadedModel.vision``): its decoder as
    :func:`create_model` builds it (same keyword arguments), plus the vision tower and
    projector in the same dtype and device."""
    from radixserve.model.arch.llava import LlavaForConditionalGeneration

    if vision.config.text != config:
        raise ValueError("vision.config.text differs from config: not the same model")
    return LlavaForConditionalGeneration.from_state_dicts(vision.config, state_dict, vision.state_dict, **kwargs)
