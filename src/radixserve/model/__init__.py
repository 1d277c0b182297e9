"""Model side of radixserve: configs, loaders (GGUF, HF safetensors), tokenizer, registry.

Only the loading API is exported here, and ``create_model`` (the model for a config;
``create_vlm`` for a vision-language model's ``LoadedModel.vision``); the
model code (``llama.py``, ``gemma3.py``, ``tiny.py``) is imported by whoever needs it (by
``create_model`` when called), so that loading a tokenizer never pulls in the model.
"""

from radixserve.model.config import ModelConfig
from radixserve.model.errors import ModelLoadError
from radixserve.model.factory import create_model, create_vlm
from radixserve.model.gguf_tokenizer import TokenizerSpec
from radixserve.model.registry import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, load_model
from radixserve.model.tokenizer import Tokenizer

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
