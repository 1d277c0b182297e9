"""Turns the last-position logits of a batch into next tokens.

Every request in a batch may have its own sampling options, so the sampler works on
per-row parameter tensors: penalties, temperature, top-k, top-p and min-p are applied as
batched tensor ops (penalties via scatter over the batch, never a Python loop per token).
Only the final random draw loops over rows, because each seeded request owns a
`torch.Generator` whose stream must not depend on which other requests share the batch.

Order of operations (the common vLLM / SGLang order):

1. mask padded vocabulary columns (``logits.shape[-1] > vocab_size``) to -inf;
2. logprobs for reporting = ``log_softmax`` of these *raw* model logits — before penalties
   and temperature, like OpenAI's ``logprobs`` and vLLM's default ("raw_logprobs"): they
   describe the model, not the sampling knobs;
3. repetition penalty (HF: prompt + output tokens), frequency / presence penalty (OpenAI:
   output tokens);
4. greedy rows (temperature < SAMPLING_EPS or top_k == 1) take the argmax of the penalized
   logits — exactly deterministic, no RNG consumed;
5. other rows: divide by temperature, top-k, then top-p over the renormalized top-k set,
   then min-p relative to the most likely token, softmax, one inverse-CDF draw (one uniform
   from the request's generator, or the global RNG when it has none).

Grammar rows (structured outputs) carry a :class:`RowConstraint`: a packed bitmask of the
allowed tokens, applied to the float32 logits after the penalties and before step 4, or a
token the grammar forces, taken without a draw (so a forced step consumes no randomness,
whether it runs alone or fast-forwarded with others). Rows without a constraint are never
touched by either: an unconstrained request gets exactly the tokens it gets alone.

Fault isolation: one row whose logits or probabilities are not finite (a model fault, an
extreme penalty) must not fail the other requests of the batch, so such rows are detected
before the draw, left out of it and reported in ``SampleOutput.errors``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from radixserve.grammar.mask import apply_bitmask
from radixserve.sampling_params import SamplingParams


class SampleOutput(NamedTuple):
    """Result of one sampling step for a batch of B rows. ``logprobs`` is None when no row
    asked for logprobs; otherwise one float per row (the raw-model logprob of the chosen token;
    computed for every row, cheap once any row needs it). ``top_logprobs`` is None when no row
    asked for alternatives; otherwise row i holds ``params[i].top_logprobs`` (token id,
    logprob) pairs, most likely first."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    # Per row: None, or why no token could be drawn (the row's token id is then -1).
    errors: list[str | None] | None = None


class RowConstraint(NamedTuple):
    """What a grammar allows for one row this step: ``forced`` (the only token; no draw),
    ``bitmask`` (int32 [words], llguidance's packed layout, ``grammar/mask.py``), or
    ``error``: the grammar failed (a parser limit) and allows nothing trustworthy — the row
    gets no token and fails with this message."""

    forced: int | None = None
    bitmask: torch.Tensor | None = None
    error: str | None = None


NO_TOKEN_ALLOWED = ("grammar: no token the grammar allows has a finite probability "
                    "(the constrained output dead-ended)")


class TokenLogprobs(NamedTuple):
    """Logprobs of given tokens (e.g. prompt tokens) plus the k most likely alternatives:
    ``chosen`` float32 [N]; ``top_ids`` int64 [N, k]; ``top_logprobs`` float32 [N, k],
    sorted descending along k (k may be 0)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None) -> torch.Tensor:
    """Return a copy of ``logits`` [B, V] with filtered-out tokens set to -inf. ``top_k``
    int64 [B] (values <= 0 or >= V mean off), ``top_p`` float [B] in (0, 1], ``min_p`` float
    [B] in [0, 1]; None skips that filter for the whole batch. The argmax token always
    survives, so every row keeps at least one finite logit (if it had one). Ties are broken
    towards the lower token id (stable sort), matching ``argmax``, which is what makes
    top_k=1 identical to greedy."""
    vocab = logits.shape[-1]
    out = logits.clone()
    if top_k is not None or top_p is not None:
        sorted_logits, sorted_idx = torch.sort(out, dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
            remove |= ranks >= k.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(remove, -math.inf)
        if top_p is not None:
            probs = torch.softmax(sorted_logits, dim=-1)
            # Probability mass strictly before each token: keep a token while the mass
            # already taken is below top_p (the first token is always kept).
            mass_before = torch.cumsum(probs, dim=-1) - probs
            p = top_p.unsqueeze(1).to(probs.dtype)
            # Rows with top_p == 1 keep everything, even where rounding makes the cumsum
            # reach 1 before the tail of tiny-probability tokens.
            remove |= (mass_before >= p) & (p < 1.0)
            remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, -math.inf)
        out = torch.empty_like(out).scatter_(1, sorted_idx, sorted_logits)
    if min_p is not None:
        # prob_i >= min_p * prob_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf
        # keeps everything. Renormalization by top-k/top-p does not change the ratio.
        max_logit = out.max(dim=-1, keepdim=True).values
        threshold = max_logit + torch.log(min_p.to(out.dtype)).unsqueeze(1)
        out = out.masked_fill(out < threshold, -math.inf)
    return out


class Sampler:
    """Batched sampler; stateless apart from the vocabulary size and device. Per-request
    randomness lives in generators created by :meth:`make_generator` and kept by the engine
    for the request's whole life, so a seeded request draws the same tokens whatever else is
    in the batch."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"Sampler.vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        """A generator seeded with ``seed`` on the sampler's device; None for no seed:
        unseeded requests draw from torch's global RNG (batched, cheaper)."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ penalties
    def apply_penalties(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                        output_ids: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Return ``logits`` [B, V] with repetition / frequency / presence penalties applied.
        Repetition penalty (HF ``RepetitionPenaltyLogitsProcessor``, vLLM): for every token
        that occurs in prompt or output, a positive logit is divided by the penalty and a
        negative one multiplied. Frequency / presence (OpenAI): ``logit -= count * freq +
        (count > 0) * presence`` with counts over output tokens only. Rows without
        penalties are left untouched; ids outside [0, V) are ignored."""
        vocab = logits.shape[-1]
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if not rep_rows and not fp_rows:
            return logits
        logits = logits.clone()
        dev = logits.device

        if rep_rows:
            seen_ids = [list(prompt_ids[i]) + list(output_ids[i]) for i in rep_rows]
            rows, toks = _flatten_ids(rep_rows, seen_ids, vocab, dev)
            seen = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
            seen[rows, toks] = True
            penalty = _column(params, rep_rows, "repetition_penalty", 1.0, logits)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)

        if fp_rows:
            rows, toks = _flatten_ids(fp_rows, [output_ids[i] for i in fp_rows], vocab, dev)
            counts = torch.zeros(logits.shape, dtype=logits.dtype, device=dev)
            counts.index_put_((rows, toks), torch.ones_like(toks, dtype=logits.dtype),
                              accumulate=True)
            freq = _column(params, fp_rows, "frequency_penalty", 0.0, logits)
            pres = _column(params, fp_rows, "presence_penalty", 0.0, logits)
            logits = logits - counts * freq - (counts > 0).to(logits.dtype) * pres
        return logits

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
               prompt_ids: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
               constraints: Sequence[RowConstraint | None] | None = None) -> SampleOutput:
        """Pick one token per row of ``logits`` [B, V] (float32, not modified in place).
        ``params``, ``output_ids`` (tokens generated so far), ``prompt_ids``, ``generators``
        (from :meth:`make_generator`, None = global RNG) and ``constraints`` (None = free;
        None for all = no row constrained) are per row."""
        batch = self._check_rows(logits, params, output_ids, prompt_ids, generators, constraints)
        if batch == 0:
            return SampleOutput([], None, None)
        logits = self._mask_padding(logits.to(torch.float32))
        want_lp = any(p.wants_logprobs for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None

        processed = self.apply_penalties(logits, params, output_ids, prompt_ids)
        rules = _RowRules.of(constraints)
        processed, next_ids, bad, no_finite = _screen(processed, logits, rules, constraints)
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy and i not in rules.forced]
        if sample_rows:
            drawn, bad_drawn = self._sample_rows(processed, params, generators, sample_rows, bad)
            next_ids[sample_rows] = drawn
            bad[sample_rows] |= bad_drawn
        for i, t in rules.forced.items():
            next_ids[i] = t
        for i in rules.failed:
            bad[i] = True
        errors = rules.errors(bad, no_finite, next_ids) if bool(bad.any()) else None
        logprobs, top = _reported_logprobs(raw_logprobs, next_ids, params)
        return SampleOutput(next_ids.tolist(), logprobs, top, errors)

    @staticmethod
    def _check_rows(logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence, prompt_ids: Sequence,
                    generators: Sequence, constraints: Sequence[RowConstraint | None] | None) -> int:
        """The batch size, or ValueError naming the argument whose length is not it."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        for name, seq in (("params", params), ("output_ids", output_ids),
                          ("prompt_ids", prompt_ids), ("generators", generators), ("constraints", constraints)):
            if seq is not None and len(seq) != batch:
                raise ValueError(f"len({name}) = {len(seq)} but logits has {batch} rows")
        return batch

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padded vocabulary columns (an embedding rounded up) set to -inf: not real tokens."""
        if logits.shape[-1] > self.vocab_size:
            logits = logits.clone()
            logits[:, self.vocab_size:] = -math.inf
        return logits

    def _sample_rows(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None], rows: list[int],
                     bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token for each of ``rows`` (non-greedy); returns the int64 ids
        [len(rows)] and which of those rows had no valid distribution (not drawn)."""
        dev = logits.device
        sub = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev))
        temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype, device=dev)
        sub = sub / temps.unsqueeze(1)

        vocab = sub.shape[-1]
        top_k = top_p = min_p = None
        if any(0 < params[i].top_k < vocab for i in rows):
            # Clamped in Python: a huge top_k must not overflow the int64 tensor.
            top_k = torch.tensor([min(params[i].top_k, vocab) for i in rows], dtype=torch.long, device=dev)
        if any(params[i].top_p < 1.0 for i in rows):
            top_p = torch.tensor([params[i].top_p for i in rows], dtype=sub.dtype, device=dev)
        if any(params[i].min_p > 0.0 for i in rows):
            min_p = torch.tensor([params[i].min_p for i in rows], dtype=sub.dtype, device=dev)
        if top_k is not None or top_p is not None or min_p is not None:
            sub = apply_top_k_top_p_min_p(sub, top_k, top_p, min_p)
        # Inverse-CDF draw: one uniform u per row, and the first token whose running sum of
        # probabilities exceeds u x the row's total (see _CdfDraw). A NaN anywhere makes the
        # row's total NaN, so the validity check needs no pass of its own.
        probs = torch.softmax(sub, dim=-1)
        draws = [_CdfDraw(probs[j]) for j in range(len(rows))]
        invalid = bad[rows] | torch.tensor([not d.valid for d in draws], dtype=torch.bool, device=dev)
        invalid_l = invalid.tolist()

        u = [0.0] * len(rows)
        unseeded = [j for j, i in enumerate(rows) if generators[i] is None and not invalid_l[j]]
        if unseeded:
            for j, v in zip(unseeded, torch.rand(len(unseeded), dtype=torch.float64, device=dev).tolist()):
                u[j] = v
        for j, i in enumerate(rows):
            gen = generators[i]
            if gen is not None and not invalid_l[j]:
                u[j] = float(torch.rand((), generator=gen, dtype=torch.float64, device=dev))
        out = torch.tensor([-1 if invalid_l[j] else d.draw(u[j]) for j, d in enumerate(draws)],
                           dtype=torch.long, device=dev)
        return out, invalid

    # ------------------------------------------------------------------ prompt logprobs

    def logprobs_of(self, logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int],
                    top_k: int = 0) -> TokenLogprobs:
        """Raw-model logprobs of ``token_ids`` [N] under ``logits`` [N, V], plus top-k: prompt
        logprobs (row n holds the logits that predict ``token_ids[n]``), defined as
        :meth:`sample`'s (log_softmax of the unpenalized, untempered logits, padding masked)."""
        logits = self._mask_padding(logits.to(torch.float32))
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
        if ids.shape != logits.shape[:1]:
            raise ValueError(f"token_ids has shape {tuple(ids.shape)}, expected ({logits.shape[0]},)")
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
        k = max(0, min(top_k, lp.shape[-1]))
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp.new_empty(lp.shape[0], 0), ids.new_empty(lp.shape[0], 0))
        return TokenLogprobs(chosen, top_ids, top_vals)


def _column(params: Sequence[SamplingParams], rows: list[int], name: str, fill: float,
            like: torch.Tensor) -> torch.Tensor:
    """One penalty knob per row as a [B, 1] column of ``like``'s dtype (``fill`` in other rows)."""
    col = torch.full((like.shape[0], 1), fill, dtype=like.dtype, device=like.device)
    col[rows, 0] = torch.tensor([getattr(params[i], name) for i in rows], dtype=like.dtype, device=like.device)
    return col


def _flatten_ids(rows: list[int], id_lists: Sequence[Sequence[int]], vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for a scatter over a [B, V] tensor, ids in range only."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    tok = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long)
    keep = (tok >= 0) & (tok < vocab)
    return row_idx[keep].to(device), tok[keep].to(device)


class _RowRules:
    """The grammar's verdicts for a batch's rows: forced tokens, rows with a mask, failures."""

    __slots__ = ("failed", "forced", "mask_rows")

    def __init__(self) -> None:
        self.forced: dict[int, int] = {}
        self.mask_rows: list[int] = []
        self.failed: dict[int, str] = {}

    @classmethod
    def of(cls, constraints: Sequence[RowConstraint | None] | None) -> "_RowRules":
        if constraints is None:
            return _NO_RULES
        rules = cls()
        for i, c in enumerate(constraints):
            if c is None:
                continue
            if c.error is not None:
                rules.failed[i] = c.error
            elif c.forced is not None:
                rules.forced[i] = c.forced
            elif c.bitmask is not None:
                rules.mask_rows.append(i)
        return rules

    def errors(self, bad: torch.Tensor, no_finite: torch.Tensor, next_ids: torch.Tensor) -> list[str | None]:
        """Per row: why no token was drawn (its id set to -1), or None."""
        errors: list[str | None] = [None] * int(bad.numel())
        masked = set(self.mask_rows)
        dead = no_finite.tolist()
        for i in bad.nonzero().flatten().tolist():
            if i in self.failed:
                errors[i] = self.failed[i]
            elif i in masked and dead[i]:
                errors[i] = NO_TOKEN_ALLOWED
            else:
                errors[i] = ("sampling failed: the next-token probabilities are not finite "
                             "(check temperature and penalties)")
            next_ids[i] = -1
        return errors


_NO_RULES = _RowRules()  # no row constrained (never changed)


def _screen(processed: torch.Tensor, logits: torch.Tensor, rules: _RowRules,
            constraints: Sequence[RowConstraint | None] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the grammar masks; returns the masked logits, each row's argmax, which rows have
    no token to give, and which of those have no finite logit at all.

    A row with NaN or +inf anywhere has no token to give (checked before masking: a model
    fault is not the grammar's). One max per row answers that and the greedy rows at once:
    it is NaN when the row holds a NaN, +inf when it holds +inf and no NaN, -inf when nothing
    is finite, and its index is argmax's (the first maximum): at a 262,144-token vocabulary
    every pass over the logits counts."""
    top, next_ids = processed.max(dim=-1)
    bad = torch.isnan(top) | torch.isposinf(top)
    if rules.mask_rows:
        bm = torch.stack([constraints[i].bitmask for i in rules.mask_rows])  # type: ignore[index, union-attr]
        processed = apply_bitmask(processed, rules.mask_rows, bm)
        top, next_ids = processed.max(dim=-1)
    no_finite = torch.isneginf(top)
    for i in (torch.isnan(top) | torch.isposinf(top)).nonzero().flatten().tolist():
        no_finite[i] = not bool(torch.isfinite(processed[i]).any())  # a faulty row: its max says too little
    bad |= no_finite
    for i in rules.forced:
        bad[i] = bool(torch.isnan(logits[i]).any())
    return processed, next_ids, bad, no_finite


def _reported_logprobs(raw: torch.Tensor | None, next_ids: torch.Tensor, params: Sequence[SamplingParams]
                       ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """The raw-model logprob of each chosen token and each row's top alternatives (None when
    no row asked). A failed row (id -1) reports the logprob of token 0, which nobody reads."""
    if raw is None:
        return None, None
    logprobs = raw.gather(1, next_ids.clamp(min=0).unsqueeze(1)).squeeze(1).tolist()
    k_max = max(p.top_logprobs for p in params)
    if k_max <= 0:
        return logprobs, None
    vals, ids = raw.topk(min(k_max, raw.shape[-1]), dim=-1)
    vals_l, ids_l = vals.tolist(), ids.tolist()
    return logprobs, [list(zip(ids_l[i][: p.top_logprobs], vals_l[i][: p.top_logprobs]))
                      for i, p in enumerate(params)]


class _CdfDraw:
    """One row's inverse-CDF draw: the first token whose running sum exceeds u x total.

    Sums run in float64, so a token of probability 1e-9 keeps its share among 262,144 (a
    float32 running sum near 0.5 rounds such a token's step by several percent). A full-row
    float64 prefix sum costs more than the rest of sampling at that vocabulary, so the row is
    cut into blocks: block sums first, then the prefix sum of the one block the target falls
    in. Each row is reduced on its own, with the same shapes whatever the batch, so a seeded
    request draws the same token alone or batched."""

    BLOCK = 1024

    def __init__(self, probs: torch.Tensor) -> None:
        self.probs = probs
        n_full = probs.numel() // self.BLOCK
        parts = [probs[: n_full * self.BLOCK].view(n_full, self.BLOCK).sum(-1, dtype=torch.float64)]
        if probs.numel() > n_full * self.BLOCK:
            parts.append(probs[n_full * self.BLOCK:].sum(dtype=torch.float64).reshape(1))
        self.block_cdf = torch.cumsum(torch.cat(parts), 0)
        self.total = total = float(self.block_cdf[-1])
        self.valid = math.isfinite(total) and total > 0

    def draw(self, u: float) -> int:
        """The token for uniform ``u`` in [0, 1); only for a valid row."""
        # u x total rounds to at most total; below it, the first index past the target is a
        # token of positive probability (a zero-probability token leaves the sum unchanged).
        target = min(u * self.total, math.nextafter(self.total, 0.0))
        cdf = self.block_cdf
        b = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)), cdf.numel() - 1)
        before = float(cdf[b - 1]) if b > 0 else 0.0
        block = self.probs[b * self.BLOCK:(b + 1) * self.BLOCK]
        inner = torch.cumsum(block, 0, dtype=torch.float64)
        k = int(torch.searchsorted(inner, torch.tensor([target - before], dtype=torch.float64), right=True))
        if k >= block.numel():
            # The block's prefix sum ended a rounding short of its block sum: its last token
            # of positive probability.
            k = int(block.nonzero()[-1])
        return b * self.BLOCK + k
