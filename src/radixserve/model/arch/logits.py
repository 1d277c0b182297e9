"""Which rows of a forward pass get logits, and how they are handed back.

The lm_head is the largest matmul of a small model's step, so it runs only on the rows whose
logits are returned: the last new token of each sequence that needs logits, plus every row
of the sequences that asked for all of them (prompt logprobs). For a 2048-token prefill that
is one row instead of 2048 × vocab, and an intermediate chunk of a chunked prefill
(``ForwardBatch.need_logits`` False) costs none. Kept apart from the decoders so every model
selects rows the same way and only supplies its head.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput


def batch_logits(hidden: torch.Tensor, batch: ForwardBatch,
                 head: Callable[[torch.Tensor], torch.Tensor], vocab_size: int) -> ForwardOutput:
    """``head`` (final norm + lm_head, float32 logits out) on the needed rows of ``hidden``."""
    n = len(batch.extend_lens)
    want_all = batch.return_all_logits or [False] * n
    need = batch.need_logits or [True] * n
    _check_flags(want_all, need, n)
    seqs = [i for i in range(n) if need[i]]
    if not seqs:
        empty = torch.empty((0, vocab_size), dtype=torch.float32, device=hidden.device)
        return ForwardOutput(next_token_logits=empty, all_logits=[None] * n, logits_seqs=[])
    if any(want_all):
        return _all_rows_logits(hidden, batch.extend_lens, want_all, need, head, seqs)
    if n == hidden.shape[0] and len(seqs) == n:  # pure decode: every row is a last row
        rows_h = hidden
    else:
        ends = list(itertools.accumulate(batch.extend_lens))
        rows_h = hidden.index_select(0, torch.tensor([ends[i] - 1 for i in seqs], device=hidden.device))
    return ForwardOutput(next_token_logits=head(rows_h), all_logits=[None] * n, logits_seqs=seqs)


def _check_flags(want_all: list[bool], need: list[bool], n: int) -> None:
    """ValueError naming the field unless both flag lists have one entry per sequence and no
    sequence asks for every logit while needing none."""
    if len(want_all) != n:
        raise ValueError(f"ForwardBatch.return_all_logits has {len(want_all)} entries, expected {n}")
    if len(need) != n:
        raise ValueError(f"ForwardBatch.need_logits has {len(need)} entries, expected {n}")
    if any(a and not b for a, b in zip(want_all, need)):
        raise ValueError("ForwardBatch.return_all_logits asks for logits of a sequence "
                         "whose need_logits is False")


def _all_rows_logits(hidden: torch.Tensor, ext: list[int], want_all: list[bool], need: list[bool],
                     head: Callable[[torch.Tensor], torch.Tensor], seqs: list[int]) -> ForwardOutput:
    """Some sequences want every position: the union of the rows, through ``head`` once."""
    dev = hidden.device
    pieces: list[torch.Tensor] = []
    last_in_rows: list[int] = []
    spans: list[tuple[int, int] | None] = []
    start = 0
    rows_n = 0
    for e, full, needed in zip(ext, want_all, need):
        if full:
            pieces.append(torch.arange(start, start + e, device=dev))
            spans.append((rows_n, rows_n + e))
            rows_n += e
            last_in_rows.append(rows_n - 1)
        elif needed:
            pieces.append(torch.tensor([start + e - 1], device=dev))
            spans.append(None)
            rows_n += 1
            last_in_rows.append(rows_n - 1)
        else:
            spans.append(None)
        start += e
    logits = head(hidden.index_select(0, torch.cat(pieces)))
    next_logits = logits.index_select(0, torch.tensor(last_in_rows, device=dev))
    all_logits = [None if span is None else logits[span[0] : span[1]] for span in spans]
    return ForwardOutput(next_token_logits=next_logits, all_logits=all_logits, logits_seqs=seqs)
