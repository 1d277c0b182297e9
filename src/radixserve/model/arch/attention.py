"""Attention backends: how new tokens' K/V reach the pool and how queries read it back.

The interface (``AttentionBackend``) is in ``attention_base``, the backends in
``attention_eager`` and ``attention_kernel``; this module builds one by name.

Backends:

* ``"torch"`` (default): on CPU with float32 / bfloat16 / quantized (int8, fp8 e4m3) pools,
  one call of the paged attention kernel of ``kernels/csrc`` per layer for the whole batch — prefills, prefills over
  a cached prefix, decodes, in any mix — reading K/V in place by slot (nothing gathered),
  plus the fused row-wise ops. Where the kernels cannot be built (their compiler output is
  logged once), or for other devices / dtypes, it runs the eager path below.
* ``"torch-eager"``: the pure-torch reference the kernels are tested against. Decode rows
  gather their K/V (one ``index_select`` per layer; a quantized pool's rows dequantized
  after the gather, with the kernels' arithmetic) into a padded batch and run two ``bmm``;
  each multi-token sequence runs ``F.scaled_dot_product_attention`` (on the fresh K/V, or on
  the gathered prefix + new K/V with an offset causal mask). Attention runs in float32.

Exactness: with the kernels a query row's result depends only on its q and the K/V at
positions up to its own (within its window, for a sliding-window layer; see
``csrc/attention.cpp``), so prefill whole, prefix + tail, chunks
and decode steps give identical bits for the same row. The eager path does not promise that
(SDPA and the decode ``bmm`` sum in different orders) — it matches to float32 rounding.
"""

from __future__ import annotations

import torch

from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.arch.attention_eager import EagerTorchAttentionBackend
from radixserve.model.arch.attention_kernel import TorchAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "torch-eager": EagerTorchAttentionBackend,
}


def make_attention_backend(name: str, device: str | torch.device = "cpu",
                           cpu_isa: str = "auto") -> AttentionBackend:
    """Build an attention backend by name: "torch" (CPU kernels where they build, else
    eager; ``cpu_isa`` caps their instruction set) or "torch-eager" (the pure-torch
    reference, no kernels). Room for "flashinfer"."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    if name == "torch":
        return TorchAttentionBackend(device=device, cpu_isa=cpu_isa)
    return _BACKENDS[name](device=device)
