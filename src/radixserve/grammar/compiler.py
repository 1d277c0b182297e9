"""Grammar compilation off the engine loop, cached by grammar text.

A request's grammar is compiled once per process per distinct text (an LRU cache); every
request gets a copy of the compiled matcher (``deep_copy`` is microseconds, compiling a large
schema can take hundreds of milliseconds). Compilation runs on a small thread pool —
llguidance drops the GIL while it builds — so neither the API's event loop nor the engine
core's step waits for it. Any reason a grammar cannot be used becomes a
:class:`~radixserve.grammar.spec.GrammarError` naming the request field.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance

from radixserve.grammar.mask import allocate_bitmask, unpack_bitmask
from radixserve.grammar.spec import JSON_DEFAULTS, GrammarError, GrammarSpec
from radixserve.grammar.matcher import GrammarState
from radixserve.grammar.ll_tokenizer import ll_tokenizer

#: Parser limits: llguidance's defaults, which bound lexer states and grammar size; a grammar
#: beyond them is refused at compile time ("grammar too large").
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, max_lexer_states=250_000,
                                    verbose_errors=False)


class CompiledGrammar:
    """A grammar ready to run: the matcher in its start state, copied for each request."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher, seconds: float):
        self.spec = spec
        self._template = matcher
        self.compile_seconds = seconds

    def new_state(self) -> GrammarState:
        return GrammarState(self._template.deep_copy())


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text of ``spec`` (GrammarError if the source does not parse)."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_DEFAULTS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        return llguidance.grammar_from("ebnf", spec.text)
    except ValueError as e:
        raise GrammarError(f"{spec.kind}: {e}", spec.kind) from None


def _first_line(msgs: list[str]) -> str:
    """The first line of llguidance's first message (without its ``<non-verbose/>`` marker)."""
    msg = msgs[0].strip() if msgs else ""
    return msg.splitlines()[0] if msg else "invalid grammar"


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one model's vocabulary; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_workers: int = 1, cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="radixserve-grammar")
        self.compiled = 0  # grammars actually compiled (cache misses)
        self.compile_seconds = 0.0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        return ll_tokenizer(self.tokenizer, self.vocab_size)

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            got = self._cache.get(spec.key)
            if got is not None:
                self._cache.move_to_end(spec.key)
            return got

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile now, in the calling thread (or return the cached result)."""
        return self.cached(spec) or self._compile_and_store(spec)

    def submit(self, spec: GrammarSpec) -> "Future[CompiledGrammar]":
        """Compile on the pool; a resolved future when cached, a shared one when in flight."""
        got = self.cached(spec)
        if got is not None:
            fut: Future = Future()
            fut.set_result(got)
            return fut
        with self._lock:
            fut = self._inflight.get(spec.key)
            if fut is not None:
                return fut
            fut = self._pool.submit(self._compile_and_store, spec)
            self._inflight[spec.key] = fut
        # Outside the lock: a future already done (a grammar that fails at once) runs the
        # callback right here, and _forget takes the lock.
        fut.add_done_callback(lambda _f, k=spec.key: self._forget(k))
        return fut

    async def acompile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``compile`` for an event loop: awaits the pool, never blocks the loop."""
        return await asyncio.wrap_future(self.submit(spec))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def _compile_and_store(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        compiled = self._build(spec, t0)
        with self._lock:
            self._cache[spec.key] = compiled
            self._cache.move_to_end(spec.key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.compiled += 1
            self.compile_seconds += compiled.compile_seconds
        return compiled

    def _build(self, spec: GrammarSpec, t0: float) -> CompiledGrammar:
        lt = self.ll_tokenizer
        grammar = to_llguidance(spec)
        is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt, limits=LIMITS)
        if is_error:
            raise GrammarError(f"{spec.kind}: {_first_line(msgs)}", spec.kind)
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind}: {_first_line([matcher.get_error()])}", spec.kind)
        self._probe(spec, matcher)
        return CompiledGrammar(spec, matcher, time.perf_counter() - t0)

    def _probe(self, spec: GrammarSpec, matcher: llguidance.LLMatcher) -> None:
        """Run, on copies, the first steps every request of this grammar will run, and refuse
        the grammar if they fail: it would fail every request anyway, after queueing.

        A grammar whose language is empty (a regex no string matches) allows no token at all,
        not even EOS. A grammar can also compile and then exceed the parser's limits (lexer
        states, Earley items) once it computes masks — ``(a{1000}){1000}``, an object of
        thousands of optional properties — so one token is taken and the next mask computed.
        The lexer is shared by every copy of a matcher: what a step costs is paid once, and a
        limit it hits fails later copies too, so a fresh copy's first mask is checked last."""
        bm = allocate_bitmask(1, self.vocab_size)
        v = bm[0]

        def mask(m: llguidance.LLMatcher, why: str = "beyond the parser's limits") -> None:
            m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)
            if m.is_error():
                raise GrammarError(f"{spec.kind}: {why} ({_first_line([m.get_error()])})", spec.kind)

        probe = matcher.deep_copy()
        forced = probe.compute_ff_tokens()
        mask(probe, "no output can match it")
        allowed = unpack_bitmask(bm, self.vocab_size)[0].nonzero().flatten().tolist()
        if not allowed:
            raise GrammarError(f"{spec.kind}: no output can match it", spec.kind)
        lt = self.ll_tokenizer
        first = forced[0] if forced else next((t for t in allowed if not lt.is_special_token(t)), None)
        if first is not None:
            if not probe.consume_token(first):
                raise GrammarError(f"{spec.kind}: beyond the parser's limits "
                                   f"({_first_line([probe.get_error()])})", spec.kind)
            mask(probe)
        mask(matcher.deep_copy())


