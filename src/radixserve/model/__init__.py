"""Model side of radixserve, one sub-package per role.

``arch/`` the decoders and their layers and attention backends; ``loaders/`` GGUF and
Hugging Face files; ``tokenization/`` text <-> token ids; ``vision/`` the image side of a
vision-language model; ``testing/`` the seeded tiny models. ``registry`` is the one entry
point (``load_model``). Only the loading API is exported here, and ``create_model`` (the
model for a config; ``create_vlm`` for a vision-language model's ``LoadedModel.vision``);
the model code is imported by whoever needs it (by ``create_model`` when called), so that
loading a tokenizer never pulls in the model.
"""

from radixserve.model.model_config import ModelConfig
from radixserve.model.load_error import ModelLoadError
from radixserve.model.arch.factory import create_model, create_vlm
from radixserve.model.tokenization.gguf_tokenizer import TokenizerSpec
from radixserve.model.registry import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, load_model
from radixserve.model.tokenization.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "TokenizerSpec",
    "create_model",
    "create_vlm",
    "load_model",
]
