"""Build one rank's model: the shard's weights in an ordinary LlamaForCausalLM plus two hooks.

A shard is itself a valid (smaller) Llama — fewer heads, a narrower MLP — so the model code
runs unchanged; the hooks make the partial results whole:

* ``all_reduce`` sums the row-parallel o_proj and down_proj outputs (two per layer);
* ``logits_gather`` (vocabulary-parallel lm_head) puts every rank's logits columns side by
  side on rank 0, which samples.

``lm_head="rank0"`` is the alternative measured by ``benchmarks/bench_tp.py``: rank 0 keeps
the whole lm_head and the other ranks compute no logits (no gather, but rank 0 alone pays
the vocabulary projection of every sampled row).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.factory import create_model
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.parallel.sharding import RankShard, lm_head_shard, shard_config, shard_state_dict

LM_HEAD_MODES = ("vocab", "rank0")


class ShardComm(Protocol):
    rank: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor: ...


def build_shard_model(config: ModelConfig, state_dict: Mapping[str, torch.Tensor], shard: RankShard,
                      comm: ShardComm, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      pack_weights: bool | None = None, lm_head: str = "vocab", cpu_isa: str = "auto",
                      linear_backend: str = "auto") -> LlamaForCausalLM:
    """Rank ``shard.rank``'s model over the full model's HF state dict (see the module doc).
    Quantized weights are refused: a rank's slice of heads or of the MLP would cut the
    rows of a fused block-format weight anywhere, and the ranks shard dense weights only."""
    from radixserve.kernels.quant_weights import QuantTensor

    quant = [k for k, v in state_dict.items() if isinstance(v, QuantTensor)]
    if quant:
        raise ValueError(f"tensor parallelism does not shard quantized weights ({quant[0]!r} is "
                         f"{state_dict[quant[0]]!r}): serve this model with --weight-dtype dense")
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
    model = create_model(shard_config(config, shard), shard_state_dict(config, state_dict, shard),
                         dtype=dtype, device=device, pack_weights=False)
    if lm_head == "vocab":
        w = lm_head_shard(config, state_dict, shard)
        vocab = config.vocab_size
        model.logits_gather = lambda t: comm.gather_columns(t, vocab)
    elif shard.rank == 0:
        w = state_dict["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    else:  # a placeholder row: the other ranks compute no logits
        w = torch.zeros((1, config.hidden_size), dtype=dtype)
    model.lm_head_weight = nn.Parameter(w.to(device=model.device, dtype=dtype).contiguous(),
                                        requires_grad=False)
    if pack_weights is not False:
        model.pack_linear_weights(linear_backend, cpu_isa)
        if pack_weights and not model.packed:
            raise ValueError(f"pack_weights=True: no packed linear backend serves device {model.device}, "
                             f"dtype {dtype}")
    model.all_reduce = comm.all_reduce
    return model


def weights_fingerprint(state_dict: Mapping[str, torch.Tensor], samples: int = 4096) -> str:
    """A hash of names, shapes, dtypes and a strided sample of every tensor: cheap, and
    enough to tell two ranks that loaded different weights apart."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(state_dict):
        t = state_dict[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        flat = t.reshape(-1)
        step = max(1, flat.numel() // samples)
        h.update(flat[::step].to(device="cpu", dtype=torch.float32).contiguous().numpy())
    return h.hexdigest()
