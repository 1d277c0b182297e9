"""Structured outputs at the engine core: requests waiting for their grammar, and what each
grammar row of a step may produce.

Grammars compile on a thread pool (``radixserve.grammar``, built on first use); a request
waits here, outside the scheduler, until its grammar is ready, so a slow compile never holds
a batch back.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from radixserve.core import Req
from radixserve.sampling_params import SamplingParams


def _failed(req: Req) -> Any:
    from radixserve.engine.sampler import RowConstraint

    return RowConstraint(error=f"grammar: {req.grammar.error}")


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
        a bitmask of the allowed ones. Rows without a grammar get nothing (never masked)."""
        rows = [r for r, smp in zip(batch.reqs, batch.sample)
                if smp and r.grammar is not None and r.params.max_tokens > len(r.output_ids)]
        if not rows:
            return None
        from radixserve.engine.sampler import RowConstraint
        from radixserve.grammar.mask import allocate_bitmask

        bound: dict[str, RowConstraint] = {}
        need_mask: list[Req] = []
        for r in rows:
            t = r.grammar.forced_token()
            if r.grammar.error is not None:
                bound[r.rid] = _failed(r)
            elif t is not None:
                bound[r.rid] = RowConstraint(forced=t)
            else:
                need_mask.append(r)
        if need_mask:
            bm = allocate_bitmask(len(need_mask), self.vocab_size)
            for j, r in enumerate(need_mask):
                r.grammar.fill_mask(bm, j)
                # A matcher that hit a parser limit still writes a mask (EOS allowed): taking
                # it would end the request as if its output had matched.
                bound[r.rid] = _failed(r) if r.grammar.error is not None else RowConstraint(bitmask=bm[j])
        return bound

    def stats(self) -> dict[str, Any]:
        c = self._compiler
        return {"grammars_compiled": c.compiled if c is not None else 0,
                "grammar_compile_seconds": c.compile_seconds if c is not None else 0.0}

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
