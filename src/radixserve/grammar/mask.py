"""Packed token bitmasks (llguidance's layout: bit ``t % 32`` of int32 word ``t // 32`` says
whether token ``t`` is allowed) applied to float32 logits."""

from __future__ import annotations

import math

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, words] CPU tensor for llguidance to fill (a word per 32 tokens)."""
    return torch.empty((rows, (vocab_size + 31) // 32), dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool [R, width]: which tokens ``bitmask`` [R, words] allows (ids past the mask: none)."""
    rows, words = bitmask.shape
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1).bool().reshape(rows, words * 32)
    if words * 32 >= width:
        return bits[:, :width]
    out = torch.zeros((rows, width), dtype=torch.bool, device=bitmask.device)
    out[:, : words * 32] = bits
    return out


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the disallowed tokens of ``rows`` set to -inf (row ``rows[j]``
    takes ``bitmask[j]``); other rows are untouched. Returns a new tensor."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, -math.inf)
    return out
