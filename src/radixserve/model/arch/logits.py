"""Which rows of a forward pass get logits, and how they are handed back.

The lm_head is the largest matmul of a small model's step, so it runs only on the rows whose
logits are returned: the last new token of each sequence that needs logits, plus every row
of the sequences that asked for all of them (prompt logprobs). For a 2048-token prefill that
is one row instead of 2048 × vocab, and an intermediate chunk of a chunked prefill
(``ForwardBatch.need_logits`` False) costs none. Kept apart from the decoders so every model
selects rows the same way and only supplies its head.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput


class LogitRows:
    """The rows of a step whose final hidden state is needed, in step order: the last new
    row of every sequence that needs logits, every row of those that want all of them.

    A decoder whose rows are batch-invariant (the kernels' path: a row's bits do not depend on
    which other rows share its matmuls) can run its last layer past the attention on these rows
    only; the K/V every row leaves in the pool come before that point. A prefill of 2,048
    tokens then runs its last layer's o, gate/up and down projections on one row, and an
    intermediate chunk of a chunked prefill on none. ``rows`` is None where every row is
    needed in order (a decode step): nothing to select.
    """

    def __init__(self, batch: ForwardBatch, total: int, device: torch.device):
        n = len(batch.extend_lens)
        want_all = batch.return_all_logits or [False] * n
        need = batch.need_logits or [True] * n
        _check_flags(want_all, need, n)
        self.seqs = [i for i in range(n) if need[i]]
        #: per sequence: (start, end) of its rows in the selected ones, when it wants them all
        self.spans: list[tuple[int, int] | None] = []
        last: list[int] = []
        picked: list[int] = []
        start = 0
        for e, full, needed in zip(batch.extend_lens, want_all, need):
            if full:
                self.spans.append((len(picked), len(picked) + e))
                picked.extend(range(start, start + e))
            elif needed:
                self.spans.append(None)
                picked.append(start + e - 1)
            else:
                self.spans.append(None)
            if needed:
                last.append(len(picked) - 1)
            start += e
        self.count = len(picked)
        every = self.count == total  # then picked is 0..total-1
        self.rows: torch.Tensor | None = None if every else torch.tensor(picked, dtype=torch.int64, device=device)
        self._last: torch.Tensor | None = None if last == list(range(self.count)) else \
            torch.tensor(last, dtype=torch.int64, device=device)

    def select(self, hidden: torch.Tensor) -> torch.Tensor:
        """The selected rows of a step's hidden states (``hidden`` as the layers return them:
        every row, or the selected ones already)."""
        if self.rows is None or hidden.shape[0] == self.count:
            return hidden
        return hidden.index_select(0, self.rows)

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
               vocab_size: int) -> ForwardOutput:
        """``head`` on the selected rows of ``hidden`` (see :meth:`select`)."""
        n = len(self.spans)
        if not self.seqs:
            empty = torch.empty((0, vocab_size), dtype=torch.float32, device=hidden.device)
            return ForwardOutput(next_token_logits=empty, all_logits=[None] * n, logits_seqs=[])
        logits = head(self.select(hidden))
        next_logits = logits if self._last is None else logits.index_select(0, self._last)
        all_logits = [None if span is None else logits[span[0] : span[1]] for span in self.spans]
        return ForwardOutput(next_token_logits=next_logits, all_logits=all_logits, logits_seqs=self.seqs)


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
