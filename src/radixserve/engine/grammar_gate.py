"""Structured outputs at the engine core: requests waiting for their grammar, and what each
grammar row of a step may produce.

Grammars compile on a thread pool (``radixserve.grammar``, built on first use); a request
waits here, outside the scheduler, until its grammar is ready, so a slow compile never holds
a batch back.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from radixserve.request import Req
from radixserve.sampling_params import SamplingParams


def _constraint(req: Req, bm: Any, j: int) -> Any:
    """What ``req``'s grammar allows next: its failure, its forced token, or a mask written to
    row ``j`` of ``bm``."""
    from radixserve.engine.sampler import RowConstraint

    g = req.grammar
    t = g.forced_token()
    if g.error is None:
        if t is not None:
            return RowConstraint(forced=t)
        g.fill_mask(bm, j)
    # A matcher that hit a parser limit still writes a mask (EOS allowed): taking it would
    # end the request as if its output had matched.
    return RowConstraint(error=f"grammar: {g.error}") if g.error is not None else RowConstraint(bitmask=bm[j])


class GrammarGate:
    """The core's grammar compiler and the requests whose grammar is still compiling."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        #: Requests whose grammar is compiling, by id, with the compile's future.
        self.compiling: dict[str, tuple[Req, Any]] = {}

    @property
    def compiler(self):  # noqa: ANN201 - GrammarCompiler, imported on first use
        """The grammar compiler of this model's vocabulary (``radixserve.grammar``)."""
        if self._compiler is None:
            from radixserve.grammar.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size)
        return self._compiler

    def check(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (cached), raising GrammarError (a ValueError)
        naming the field if it cannot be used."""
        spec = params.grammar
        if spec is not None:
            self.compiler.compile(spec)

    def submit(self, req: Req, spec: Any) -> bool:
        """Start compiling ``spec`` for ``req``. True when it is ready at once (``req.grammar``
        is set: the request may be scheduled); else the request waits in :attr:`compiling`."""
        fut = self.compiler.submit(spec)
        if fut.done() and fut.exception() is None:
            req.grammar = fut.result().new_state()
            return True
        self.compiling[req.rid] = (req, fut)
        return False

    def finished(self) -> list[tuple[Req, BaseException | None]]:
        """The requests whose grammar finished compiling, taken out of :attr:`compiling`, each
        with None (``req.grammar`` is set) or the error it failed with."""
        done: list[tuple[Req, BaseException | None]] = []
        for rid, (req, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            err = fut.exception()
            if err is None:
                req.grammar = fut.result().new_state()
            done.append((req, err))
        return done

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or ``timeout`` seconds pass."""
        concurrent.futures.wait([f for _, f in self.compiling.values()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def constraints(self, batch: Any) -> dict[str, Any] | None:
        """What each grammar row of this step may produce, by request id: the forced token, or
        a bitmask of the allowed ones. Rows without a grammar get nothing (never masked), nor
        do rows with a draft (:meth:`draft_constraints`)."""
        rows = [r for i, (r, smp) in enumerate(zip(batch.reqs, batch.sample))
                if smp and r.grammar is not None and r.params.max_tokens > len(r.output_ids)
                and not batch.draft(i)]
        if not rows:
            return None
        from radixserve.grammar.mask import allocate_bitmask

        bm = allocate_bitmask(len(rows), self.vocab_size)
        return {r.rid: _constraint(r, bm, j) for j, r in enumerate(rows)}

    def draft_constraints(self, batch: Any) -> dict[str, list[Any]] | None:
        """For each grammar row verifying a draft (speculative decoding), by request id: the
        constraint of each of its first positions (``len(draft) + 1`` of them, fewer where the
        grammar refuses a draft token: up to and including that token's), the one plain
        decoding would apply there (:meth:`constraints` of the grammar having taken the draft's tokens before
        it). The grammar is walked through the draft and rolled back: the tokens it keeps are
        fed to it after verification, as plain decoding feeds each sampled one."""
        from radixserve.engine.sampler import RowConstraint
        from radixserve.grammar.mask import allocate_bitmask

        out: dict[str, list[RowConstraint]] = {}
        for i, r in enumerate(batch.reqs):
            draft = batch.draft(i)
            g = r.grammar
            if not draft or g is None:
                continue
            k = len(draft)
            # Never feed the matcher a token it refuses (that would leave it in error): walk
            # only the draft's valid prefix (the speculator proposes no more than that).
            valid = g.valid_prefix(draft)
            bm = allocate_bitmask(k + 1, self.vocab_size)
            cons: list[RowConstraint] = []
            taken = 0
            for j in range(k + 1):
                cons.append(_constraint(r, bm, j))
                if j == min(k, valid) or g.error is not None or g.stopped or not g.accept(draft[j]):
                    break
                taken += 1
            # Past a token the grammar refuses (or its end) nothing is verified: the list is
            # shorter than the draft's positions, and the runner verifies only its length.
            g.rollback(taken)
            out[r.rid] = cons
        return out or None

    def stats(self) -> dict[str, Any]:
        c = self._compiler
        return {"grammars_compiled": c.compiled if c is not None else 0,
                "grammar_compile_seconds": c.compile_seconds if c is not None else 0.0}

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
