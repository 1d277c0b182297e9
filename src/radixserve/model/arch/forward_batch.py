"""What one forward pass needs to know: new tokens, where their K/V go, what they attend to.

The model sees slot indices only, never the tree or the requests: each sequence in the batch
is a run of new tokens (``extend_lens[i]`` of them, at positions ``prefix_lens[i]`` ...)
whose K/V are written to ``out_slots``, and which attend over ``seq_slots[i]`` — the slots of
the cached/earlier prefix followed by the slots of the new tokens, in position order.

A batch may mix any number of decode steps (one new token) and prefill chunks (many new
tokens, with or without a cached prefix): the attention kernel serves them in one call.
``need_logits`` says which sequences need logits at all — an intermediate chunk of a chunked
prefill needs none, so the lm_head skips it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64: their absolute positions
    out_slots: torch.Tensor  # [T] int64: KV slots where each new token's K/V is written
    seq_slots: list[torch.Tensor]  # per sequence: int64 slots of prefix + new tokens (len = prefix + extend)
    prefix_lens: list[int]  # per sequence: tokens already in the pool before this pass
    extend_lens: list[int]  # per sequence: new tokens in this pass (>= 1)
    # Per sequence: True to get logits for every new position (prompt logprobs), not just the last.
    return_all_logits: list[bool] = field(default_factory=list)
    # Per sequence: False when this pass needs no logits for it (an intermediate prefill chunk).
    # Empty means every sequence needs them.
    need_logits: list[bool] = field(default_factory=list)
    # [T, hidden] float32: the decoder's input rows in place of the embedding lookup of
    # input_ids (a vision-language model's prompt with image features at its placeholder
    # tokens, radixserve.model.arch.llava); None for text, where input_ids are embedded.
    input_embeds: torch.Tensor | None = None
    # Per sequence: the slot of its Mamba state (``radixserve.memory.mamba``) holding the state
    # after its ``prefix_lens[i]`` tokens, advanced in place by the pass; empty for a model
    # without Mamba layers.
    state_slots: list[int] = field(default_factory=list)
    # Per sequence: True where the pass must not write its Mamba state but stage the states
    # after each of its positions (``MambaStatePool.stage``): a speculative step's row, whose
    # kept positions are known only after sampling. Empty: none.
    state_staged: list[bool] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens)

    @classmethod
    def build(cls, token_ids: list[list[int]], prefix_lens: list[int], seq_slots: list[torch.Tensor],
              return_all_logits: list[bool] | None = None, device: str | torch.device = "cpu",
              need_logits: list[bool] | None = None) -> "ForwardBatch":
        """Assemble a batch from per-sequence new tokens and full slot lists.

        ``seq_slots[i]`` must hold ``prefix_lens[i] + len(token_ids[i])`` slots; the last
        ``len(token_ids[i])`` of them receive the new K/V. ``need_logits`` (default: all
        True) marks the sequences whose logits this pass must return.
        """
        if len(prefix_lens) != len(token_ids) or len(seq_slots) != len(token_ids):
            raise ValueError(f"token_ids ({len(token_ids)}), prefix_lens ({len(prefix_lens)}) and seq_slots "
                             f"({len(seq_slots)}) need one entry per sequence")
        if need_logits is not None and len(need_logits) != len(token_ids):
            raise ValueError(f"need_logits has {len(need_logits)} entries, expected {len(token_ids)}")
        extend_lens = [len(t) for t in token_ids]
        if any(e < 1 for e in extend_lens):
            raise ValueError("every sequence in a forward batch needs at least one new token")
        for i, (s, p, e) in enumerate(zip(seq_slots, prefix_lens, extend_lens)):
            if s.numel() != p + e:
                raise ValueError(f"seq_slots[{i}] has {s.numel()} slots, expected {p + e}")
        flat = [t for ids in token_ids for t in ids]
        input_ids = torch.tensor(flat, dtype=torch.int64, device=device)
        if all(e == 1 for e in extend_lens):  # decode: one position and one slot per sequence
            positions = torch.tensor(list(prefix_lens), dtype=torch.int64, device=device)
            out_slots = torch.stack([s[p] for s, p in zip(seq_slots, prefix_lens)]).to(device)
        else:
            positions = torch.cat([torch.arange(p, p + e, dtype=torch.int64)
                                   for p, e in zip(prefix_lens, extend_lens)]).to(device)
            out_slots = torch.cat([s[p:] for s, p in zip(seq_slots, prefix_lens)]).to(device)
        return cls(input_ids=input_ids, positions=positions, out_slots=out_slots,
                   seq_slots=[s.to(device) for s in seq_slots], prefix_lens=list(prefix_lens), extend_lens=extend_lens,
                   return_all_logits=list(return_all_logits or [False] * len(extend_lens)),
                   need_logits=list(need_logits) if need_logits is not None else [])


@dataclass
class ForwardOutput:
    # [len(logits_seqs), vocab] float32: logits at the last new token of each sequence that
    # needs logits (all of them unless ForwardBatch.need_logits says otherwise), in batch order.
    next_token_logits: torch.Tensor
    # Per sequence: [extend_len, vocab] float32 logits of every new position when asked, else None.
    all_logits: list[torch.Tensor | None]
    # Batch indices of the sequences the rows of next_token_logits belong to.
    logits_seqs: list[int] = field(default_factory=list)
