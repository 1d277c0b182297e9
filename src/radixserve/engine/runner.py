"""ModelRunner: the engine's one handle on the model, the KV pool and the attention backend.

A thin wrapper on purpose: the scheduler builds a :class:`ForwardBatch` (slot indices only),
the runner runs it under ``inference_mode`` and keeps timing counters the engine reports.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model.attention import AttentionBackend, make_attention_backend
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch, ForwardOutput
from radixserve.model.llama import LlamaForCausalLM


class ModelRunner:
    """Runs forward passes and counts time and tokens (prefill vs decode)."""

    def __init__(self, model: LlamaForCausalLM, kv_pool: KVPool, attn_backend: AttentionBackend):
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.config = model.config
        self.device = model.device
        self.reset_stats()

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        kv_capacity: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "torch",
        kv_dtype: torch.dtype | None = None,
        pack_weights: bool | None = None,
    ) -> "ModelRunner":
        """Build model (weights in ``dtype``), a KV pool of ``kv_capacity`` slots and a backend.

        ``kv_dtype`` defaults to ``dtype``: a bfloat16 model keeps a bfloat16 cache (half the
        memory, so twice the cached prefixes). ``pack_weights``: see
        :meth:`LlamaForCausalLM.from_state_dict` (None = oneDNN-packed linears where supported).
        """
        if kv_capacity < 1:
            raise ValueError(f"kv_capacity must be >= 1, got {kv_capacity}")
        model = LlamaForCausalLM.from_state_dict(
            config, state_dict, dtype=dtype, device=device, pack_weights=pack_weights
        )
        pool = KVPool(
            num_layers=config.num_layers,
            capacity=kv_capacity,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=kv_dtype or dtype,
            device=device,
        )
        return cls(model, pool, make_attention_backend(backend, device))

    def reset_stats(self) -> None:
        self.forward_seconds = 0.0
        self.forward_calls = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.forward(batch, self.kv_pool, self.attn_backend)
        if self.device.type == "cuda":
            # Honest timing: kernels are async; the sampler would wait for them anyway.
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        self.forward_calls += 1
        n = int(batch.input_ids.numel())
        if batch.is_decode:
            self.decode_tokens += n
        else:
            self.prefill_tokens += n
        return out

    def stats(self) -> dict[str, float]:
        return {
            "forward_seconds": self.forward_seconds,
            "forward_calls": float(self.forward_calls),
            "prefill_tokens": float(self.prefill_tokens),
            "decode_tokens": float(self.decode_tokens),
        }
