"""Shared pytest fixtures (session-scoped: weights are built once per test run).

Other suites add their own fixtures here (e.g. a session-scoped ``smollm2`` real model).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

import radixserve  # noqa: F401  (first: under RADIXSERVE_CPU_ISA it caps torch's libraries)
import torch

# The tests import the *installed* package (pip install -e ".[test]"), never src/ by path:
# what they check is what users get. Helper modules of the suite live next to the tests.
_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

# One torch thread: the tiny model's ops take microseconds, and on a machine shared with
# other jobs two OpenMP threads spin-waiting on each other make them take milliseconds.
torch.set_num_threads(1)

from radixserve.model.model_config import ModelConfig  # noqa: E402
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _collect_after_module():
    """Engines left by a module (packed weights, KV pools: hundreds of MB each) often sit in
    reference cycles with their threads; collecting them before the next module loads its own
    models keeps the one-process suite's memory near what one module needs."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    """The tiny random Llama config (2 layers, hidden 64, GQA 4/2, vocab 512, tied)."""
    return tiny_random_config()


@pytest.fixture(scope="session")
def tiny_state_dict(tiny_config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for ``tiny_config`` in Hugging Face naming (do not mutate)."""
    return tiny_random_state_dict(seed=0, config=tiny_config)


@pytest.fixture(scope="session")
def smollm2_loaded():
    """The real SmolLM2-135M-Instruct (float32), loaded once per test run."""
    from fixtures_smollm2 import _load_smollm2, require_smollm2

    require_smollm2()
    return _load_smollm2()


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny random model with its byte-level tokenizer, as the engine loads it."""
    from radixserve.model.registry import load_model

    return load_model("tiny-random", dtype=torch.float32)
