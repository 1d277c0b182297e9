"""One request's grammar: where it stands, what it allows next, what it forces.

Forced text (a key of a schema, the punctuation between fields) always becomes the grammar's
own tokens for it (llguidance's fast-forward tokens: the model's BPE tokenization of the
forced bytes, cut where a later byte could still merge). Plain decoding takes them one per
step (the step's only allowed token, no random draw); fast-forward appends the same tokens
at once. Both therefore produce the same tokens, greedy or sampled.
"""

from __future__ import annotations

import llguidance
import torch


#: Forced tokens kept from one computation. llguidance computes the whole forced run at once
#: (up to ~500,000 tokens for a 15-character regex): recomputing it for every token taken
#: made a long forced run cost its square, on the engine's loop.
FORCED_RUN_KEPT = 4096


class GrammarState:
    """A live llguidance matcher for one request (created from a compiled template)."""

    __slots__ = ("matcher", "accepted", "_forced")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.accepted = 0  # tokens consumed, for rollback
        self._forced: list[int] = []  # the rest of the forced run, next token last

    def forced_token(self) -> int | None:
        """The next token if the grammar forces one, else None (a mask is needed)."""
        if self.matcher.is_stopped():
            return None
        if not self._forced:
            self._forced = self.matcher.compute_ff_tokens()[:FORCED_RUN_KEPT][::-1]
        return self._forced[-1] if self._forced else None

    def forced_run(self, k: int) -> list[int]:
        """The next up to ``k`` tokens the grammar forces, in order, none consumed (a draft
        that needs no guessing: speculative decoding verifies it for its logprobs and KV)."""
        if k < 1 or self.forced_token() is None:
            return []
        return self._forced[: -k - 1 : -1]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, the grammar would accept in a row from
        where it stands (nothing consumed): a draft past that point can never be accepted."""
        if not tokens or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(tokens)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask of the current state into ``bitmask[row]``."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        """Consume a sampled (or forced) token; False if the grammar refuses it."""
        ok = self.matcher.consume_token(token)
        if ok:
            self.accepted += 1
        if ok and self._forced and self._forced[-1] == token:
            self._forced.pop()  # the run goes on: its next token is still forced
        else:
            self._forced = []
        return ok

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` accepted tokens (they were taken back from the output)."""
        n = min(n, self.accepted)
        self._forced = []
        if n:
            self.matcher.rollback(n)
            self.accepted -= n

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (its first line: llguidance appends a ``<non-verbose/>``
        marker where verbose errors would go), or None."""
        if not self.matcher.is_error():
            return None
        return (self.matcher.get_error().strip().splitlines() or ["grammar error"])[0]
