"""Which part of a Llama / Qwen2 each tensor-parallel rank holds (Megatron-style).

Per layer, q/k/v and gate/up are split by output rows (column-parallel: each rank computes
its heads and its slice of the intermediate activations from the full hidden state) and
o_proj / down_proj by input columns (row-parallel: each rank's product is a partial sum of
the full output, summed by one all-reduce each). Norms and the embedding table are
replicated; the lm_head is split by vocabulary rows (see :func:`vocab_split`).

Head rules (``head_split``), with ``G = num_heads // num_kv_heads`` query heads per KV head:

* ``N <= num_kv_heads``: the KV heads are split into N contiguous runs whose sizes differ by
  at most one, and each rank takes the G query heads of each of its KV heads. No KV head is
  stored twice. When N does not divide the KV heads the split is uneven — SmolLM2 (9 heads,
  3 KV heads) at N = 2 gives rank 0 six query heads over two KV heads and rank 1 three over
  one. Padding with dummy heads to even it out would not help: the rank with the most heads
  bounds the step either way (it holds ``ceil(num_kv_heads / N) * G`` heads in both
  schemes), and the dummies would cost compute and KV memory on the other ranks.
* ``N > num_kv_heads``: every KV head is replicated on ``N // num_kv_heads`` or one more
  ranks (contiguous), and its G query heads are split among them (sizes differing by at
  most one). Each rank then holds one KV head, so its local query-to-KV mapping stays the
  uniform grouped one the attention kernels assume.

In both cases a rank's query heads map onto its KV heads in equal groups, so a shard is
again a valid GQA model (:func:`shard_config`). ``N`` must not exceed the query heads.

The intermediate size is split into near-equal contiguous runs; the vocabulary into runs of
``ceil(vocab / N)`` rows, the last one padded with zero rows (its padded logits are cut off
after the gather).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from radixserve.model.model_config import ModelConfig


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``size`` holds, as ranges of global indices."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range  # lm_head rows this rank computes (empty possible for tiny vocabularies)
    vocab_per_rank: int  # rows of every rank's lm_head shard (vocab padded to size * this)

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def split_even(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous runs whose lengths differ by at most one
    (the longer runs first)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]  # the first ``extra`` runs are longer
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def head_split(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[range, range]]:
    """Per rank: (query heads, KV heads), following the rules of the module docstring."""
    if size < 1:
        raise ValueError(f"tp_size must be >= 1, got {size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if size > num_heads:
        raise ValueError(f"tp_size ({size}) exceeds the model's {num_heads} attention heads: "
                         "every rank needs at least one query head")
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        return [(range(kv.start * group, kv.stop * group), kv) for kv in split_even(num_kv_heads, size)]
    out: list[tuple[range, range]] = []
    for kv, ranks in enumerate(split_even(size, num_kv_heads)):
        for q in split_even(group, len(ranks)):
            out.append((range(kv * group + q.start, kv * group + q.stop), range(kv, kv + 1)))
    return out


def vocab_split(vocab_size: int, size: int) -> tuple[list[range], int]:
    """Per rank the vocabulary rows of its lm_head shard, and the padded rows per rank."""
    per = -(-vocab_size // size)
    return [range(min(r * per, vocab_size), min((r + 1) * per, vocab_size)) for r in range(size)], per


def plan_shards(config: ModelConfig, size: int) -> list[RankShard]:
    """Every rank's shard of ``config`` for a tensor-parallel group of ``size`` (ValueError
    when the model cannot be split that way)."""
    if config.arch not in ("llama", "qwen2"):
        raise ValueError(f"tensor parallelism supports Llama / Qwen2 models, not arch {config.arch!r} "
                         "(run it with tp_size 1)")
    heads = head_split(config.num_heads, config.num_kv_heads, size)
    if size > config.intermediate_size:
        raise ValueError(f"tp_size ({size}) exceeds the intermediate size ({config.intermediate_size})")
    inter = split_even(config.intermediate_size, size)
    vocab, per = vocab_split(config.vocab_size, size)
    return [RankShard(r, size, q, kv, inter[r], vocab[r], per) for r, (q, kv) in enumerate(heads)]


def shard_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The model one rank runs: its heads and intermediate slice, the full hidden size and
    vocabulary (embedding replicated). ``tie_word_embeddings`` is True so the loader shares
    the embedding as a placeholder lm_head, which :func:`lm_head_shard` then replaces."""
    return dataclasses.replace(config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                               intermediate_size=len(shard.intermediate), tie_word_embeddings=True)


def shard_state_dict(config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                     shard: RankShard) -> dict[str, torch.Tensor]:
    """One rank's weights in Hugging Face naming (shapes of :func:`shard_config`), without
    ``lm_head.weight``. Slices are views of ``state_dict``; the model's loader copies what
    it fuses or makes contiguous."""
    d = config.head_dim
    q0, q1 = shard.q_heads.start * d, shard.q_heads.stop * d
    k0, k1 = shard.kv_heads.start * d, shard.kv_heads.stop * d
    i0, i1 = shard.intermediate.start, shard.intermediate.stop
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
            continue
        leaf = name.rsplit(".", 2)
        kind = ".".join(leaf[-2:]) if len(leaf) >= 2 else name
        if kind in ("q_proj.weight", "q_proj.bias"):
            t = t[q0:q1]
        elif kind in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            t = t[k0:k1]
        elif kind == "o_proj.weight":
            t = t[:, q0:q1]
        elif kind in ("gate_proj.weight", "up_proj.weight"):
            t = t[i0:i1]
        elif kind == "down_proj.weight":
            t = t[:, i0:i1]
        out[name] = t
    return out


def lm_head_shard(config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                  shard: RankShard) -> torch.Tensor:
    """This rank's lm_head rows ``[vocab_per_rank, hidden]``, zero rows past the vocabulary."""
    name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    full = state_dict[name]
    rows = full[shard.vocab.start : shard.vocab.stop]
    if len(shard.vocab) == shard.vocab_per_rank:
        return rows
    out = torch.zeros((shard.vocab_per_rank, full.shape[1]), dtype=full.dtype, device=full.device)
    out[: len(shard.vocab)] = rows
    return out
