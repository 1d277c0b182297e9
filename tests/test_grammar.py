"""Grammar backend pieces with the real llguidance and the tiny model's vocabulary: specs
and their limits, compilation (errors, cache, thread pool), masks in the sampler, and the
tool-call grammar and parser."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from radixserve.engine.sampler import NO_TOKEN_ALLOWED, RowConstraint, Sampler
from radixserve.grammar.compiler import GrammarCompiler
from radixserve.grammar.mask import allocate_bitmask, unpack_bitmask
from radixserve.grammar.spec import MAX_GRAMMAR_CHARS, GrammarError, GrammarSpec, schema_text
from radixserve.grammar.tools import (ToolCallStream, call_grammar, parse_tool_calls, parse_tool_choice,
                                      parse_tools)
from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def compiler(tiny_loaded) -> GrammarCompiler:
    c = GrammarCompiler(tiny_loaded.tokenizer, tiny_loaded.config.vocab_size)
    yield c
    c.close()


# ---------------------------------------------------------------- specs and params

def test_sampling_params_grammar_fields() -> None:
    p = SamplingParams(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    assert p.grammar == GrammarSpec("json_schema", '{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert SamplingParams(regex="a+").grammar == GrammarSpec("regex", "a+")
    assert SamplingParams().grammar is None
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(ValueError, match="regex must not be empty"):
        SamplingParams(regex="")
    with pytest.raises(ValueError, match="grammar too large"):
        SamplingParams(regex="a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match="must be a string"):
        SamplingParams(ebnf=3)  # type: ignore[arg-type]


def test_schema_text_keeps_property_order() -> None:
    assert schema_text('{"z": 1, "a": 2}') == '{"z": 1, "a": 2}'
    with pytest.raises(GrammarError, match="must be a JSON object"):
        schema_text("[1]")


# ---------------------------------------------------------------- compiler

@pytest.mark.parametrize("spec,match", [
    (GrammarSpec("regex", "(["), "regex"),
    (GrammarSpec("regex", "[^\\x00-\\U0010ffff]"), "no output can match"),
    (GrammarSpec("json_schema", schema_text({"type": "strin"})), "Invalid type"),
    (GrammarSpec("json_schema", schema_text({"type": "object", "if": {}})), "Unimplemented"),
    (GrammarSpec("json_schema", schema_text({"type": "integer", "minimum": 5, "maximum": 1})),
     "Unsatisfiable"),
    (GrammarSpec("ebnf", "root ::= undefined_rule"), "not found"),
])
def test_compile_errors_name_the_problem(compiler: GrammarCompiler, spec: GrammarSpec, match: str) -> None:
    with pytest.raises(GrammarError, match=match) as e:
        compiler.compile(spec)
    assert e.value.field == spec.kind
    with pytest.raises(GrammarError):  # through the pool too
        compiler.submit(spec).result(timeout=30)


def test_submit_of_a_grammar_that_fails_at_once_never_deadlocks(compiler: GrammarCompiler, monkeypatch) -> None:
    """A compile that is done before ``submit`` adds its done-callback runs the callback in
    the caller's thread; it must not need the lock ``submit`` holds (it did: the server's
    event loop froze on a bad regex now and then). The pool here runs the job inside
    ``submit``: a grammar that fails before storing anything is then that race every time."""
    import threading
    from concurrent.futures import Future

    class DoneAtOnce:
        def submit(self, fn, *args):  # noqa: ANN001, ANN202
            fut: Future = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the future carries it
                fut.set_exception(e)
            return fut

    monkeypatch.setattr(compiler, "_pool", DoneAtOnce())
    outcome: list[object] = []

    def go() -> None:
        fut = compiler.submit(GrammarSpec("regex", "([ at once"))
        outcome.append(fut.exception())

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "submit deadlocked"
    assert isinstance(outcome[0], GrammarError)
    assert not compiler._inflight  # the callbacks ran


def test_compile_is_cached_by_text(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("regex", "cached-[0-9]{2}")
    before = compiler.compiled
    a = compiler.submit(spec).result(timeout=30)
    b = compiler.compile(GrammarSpec("regex", "cached-[0-9]{2}"))
    assert a is b and compiler.compiled == before + 1
    s1, s2 = a.new_state(), a.new_state()
    assert s1.matcher is not s2.matcher  # each request gets its own copy


def test_forced_tokens_and_mask(compiler: GrammarCompiler, tiny_loaded) -> None:
    tok = tiny_loaded.tokenizer
    st = compiler.compile(GrammarSpec("regex", "hello (world|there)")).new_state()
    forced: list[int] = []
    while (t := st.forced_token()) is not None:
        assert st.accept(t)
        forced.append(t)
    assert tok.decode(forced).startswith("hello")
    bm = allocate_bitmask(1, tiny_loaded.config.vocab_size)
    st.fill_mask(bm, 0)
    allowed = unpack_bitmask(bm, tiny_loaded.config.vocab_size)[0].nonzero().flatten().tolist()
    texts = {tok.decode([a]) for a in allowed}
    rest = "hello (world|there)"
    assert allowed and all(("hello world".startswith(tok.decode(forced) + t) or
                            "hello there".startswith(tok.decode(forced) + t)) for t in texts), (texts, rest)


# ---------------------------------------------------------------- sampler

def test_sampler_masks_only_constrained_rows() -> None:
    torch.manual_seed(0)
    V = 100
    s = Sampler(V)
    logits = torch.randn(3, V)
    bm = torch.zeros(1, 4, dtype=torch.int32)
    bm[0, 1] = 1 << 5  # only token 37
    params = [SamplingParams(temperature=0)] * 3
    out = s.sample(logits, params, [[], [], []], [[1], [1], [1]], [None] * 3,
                   [None, RowConstraint(bitmask=bm[0]), RowConstraint(forced=7)])
    free = s.sample(logits[:1], params[:1], [[]], [[1]], [None])
    assert out.token_ids == [free.token_ids[0], 37, 7]
    assert out.errors is None


def test_sampler_forced_rows_draw_nothing() -> None:
    """A forced step consumes no randomness: the next draw is what it would be without it."""
    V = 50
    s = Sampler(V)
    logits = torch.randn(1, V)
    p = [SamplingParams(temperature=1.0)]
    g1, g2 = s.make_generator(5), s.make_generator(5)
    s.sample(logits, p, [[]], [[1]], [g1], [RowConstraint(forced=3)])
    a = s.sample(logits, p, [[]], [[1]], [g1]).token_ids
    b = s.sample(logits, p, [[]], [[1]], [g2]).token_ids
    assert a == b


def test_sampler_constraints_and_dead_end() -> None:
    V = 64
    s = Sampler(V)
    out_a, out_b = [], []
    logits = torch.zeros(2, V)
    logits[1, :] = -math.inf
    logits[1, 3] = 0.0  # only token 3 is finite, and the grammar allows only token 4
    bm = torch.zeros(2, 2, dtype=torch.int32)
    bm[1, 0] = 1 << 4
    greedy = [SamplingParams(temperature=0)] * 2
    res = s.sample(logits, greedy, [out_a, out_b], [[1], [1]], [None, None], [None, RowConstraint(bitmask=bm[1])])
    assert res.errors == [None, NO_TOKEN_ALLOWED] and res.token_ids[1] == -1
    res = s.sample(logits, greedy, [out_a, out_b], [[1], [1]], [None, None], [RowConstraint(forced=5), None])
    assert res.token_ids == [5, 3]
    with pytest.raises(ValueError, match="constraints"):
        s.sample(logits, greedy, [out_a, out_b], [[1], [1]], [None, None], [RowConstraint(forced=1)])


# ---------------------------------------------------------------- tools

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "noop"}},
]


def test_tool_parsing_and_choice() -> None:
    tools = parse_tools(TOOLS)
    assert [t.name for t in tools] == ["get_weather", "noop"]
    assert parse_tool_choice({"type": "function", "function": {"name": "noop"}}, tools).names == ("noop",)
    for bad in ([{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}], []):
        with pytest.raises(ValueError, match="tools"):
            parse_tools(bad)
    with pytest.raises(ValueError, match="not in tools"):
        parse_tool_choice({"type": "function", "function": {"name": "zzz"}}, tools)
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, {"get_weather"})
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"}
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>")[1] == []


def test_tool_stream_splits_content_and_calls() -> None:
    text = 'ok <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "get_weather", "arguments": {"city": "A", "unit": "f"}}\n</tool_call>'
    for step in (1, 3, 7, len(text)):
        st = ToolCallStream({"noop", "get_weather"})
        content, deltas = "", []
        for i in range(0, len(text), step):
            c, d = st.feed(text[i:i + step])
            content += c
            deltas += d
        content += st.finish()
        assert content == "ok "
        assert [d.get("function", {}).get("name") for d in deltas if "id" in d] == ["noop", "get_weather"]
        args = {}
        for d in deltas:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
        assert json.loads(args[1]) == {"city": "A", "unit": "f"}


def test_tool_call_grammar_forces_a_parsable_call(compiler: GrammarCompiler, tiny_loaded) -> None:
    """Walk the call grammar with arbitrary allowed tokens: whatever is chosen parses."""
    tools = parse_tools(TOOLS)
    g = call_grammar(tools, parse_tool_choice("required", tools), parallel=False)
    st = compiler.compile(GrammarSpec("ebnf", g)).new_state()
    V = tiny_loaded.config.vocab_size
    bm = allocate_bitmask(1, V)
    rng = torch.Generator().manual_seed(0)
    out: list[int] = []
    for _ in range(400):
        if st.stopped:
            break
        t = st.forced_token()
        if t is None:
            st.fill_mask(bm, 0)
            allowed = unpack_bitmask(bm, V)[0].nonzero().flatten()
            allowed = allowed[allowed != tiny_loaded.tokenizer.eos_token_id] if len(allowed) > 1 else allowed
            # prefer short strings so the walk ends: the lowest ids are single bytes
            t = int(allowed[torch.randint(0, min(len(allowed), 8), (1,), generator=rng)])
        assert st.accept(t)
        out.append(t)
        if st.matcher.is_accepting():
            break
    text = tiny_loaded.tokenizer.decode(out)
    _, calls = parse_tool_calls(text, {"get_weather", "noop"})
    assert len(calls) == 1, text
    assert re.fullmatch(r"<tool_call>\n\{.*\}\n</tool_call>", text, re.S)


def test_a_grammar_row_in_error_fails_alone_also_with_logprobs() -> None:
    """A row whose grammar failed (its matcher in error: any mask it computes is garbage) gets
    no token and that error; the other rows of the batch — one of them asking for logprobs —
    are sampled as without it."""
    s = Sampler(64, "cpu")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=g)
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=2)] * 3
    out = s.sample(logits, params, [[]] * 3, [[1]] * 3, [None] * 3,
                   [None, RowConstraint(error="grammar: lexer error"), RowConstraint(forced=5)])
    assert out.errors == [None, "grammar: lexer error", None]
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[1] == -1 and out.token_ids[2] == 5
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))


def test_a_row_with_no_finite_logit_fails_alone_also_with_logprobs() -> None:
    s = Sampler(64, "cpu")
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = math.nan
    out = s.sample(logits, [SamplingParams(temperature=0, logprobs=True)] * 2, [[]] * 2, [[1]] * 2, [None] * 2)
    assert out.errors[0] is None and out.errors[1] and out.token_ids[1] == -1
    assert out.token_ids[0] == int(logits[0].argmax())


class _CountingMatcher:
    """The real matcher, counting how often the forced run is computed."""

    def __init__(self, matcher: object):
        self._m = matcher
        self.runs_computed = 0

    def compute_ff_tokens(self) -> list[int]:
        ff = self._m.compute_ff_tokens()
        self.runs_computed += bool(ff)
        return ff

    def __getattr__(self, name: str) -> object:
        return getattr(self._m, name)


@pytest.mark.parametrize("kind,text", [
    ("regex", "a{3000}"),
    ("regex", "(ab|cd){40}x{100}[0-9]{1,3}end"),
    ("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                                                "tags": {"type": "array", "items": {"enum": ["x", "yy"]},
                                                                         "maxItems": 3}},
                                "required": ["name", "tags"], "additionalProperties": False})),
])
def test_forced_tokens_are_computed_once_per_forced_run(compiler: GrammarCompiler, tiny_loaded, kind: str,
                                                         text: str) -> None:
    """Taking a long forced run token by token computes it once, not once per token (that cost
    the square of the run on the engine's loop), and gives the tokens a fresh computation at
    every step gives."""
    compiled = compiler.compile(GrammarSpec(kind, text))
    st = compiled.new_state()
    counting = _CountingMatcher(st.matcher)
    st.matcher = counting  # type: ignore[assignment]
    ref = compiled.new_state().matcher  # recomputes at every step, as before
    bm = allocate_bitmask(1, tiny_loaded.config.vocab_size)
    forced = runs = 0
    was_forced = False
    for _ in range(4000):
        if st.stopped:
            break
        t = st.forced_token()
        ff = ref.compute_ff_tokens()
        assert t == (ff[0] if ff else None)
        if t is None:
            st.fill_mask(bm, 0)
            allowed = unpack_bitmask(bm, tiny_loaded.config.vocab_size)[0].nonzero().flatten().tolist()
            t = next(a for a in allowed if a not in tiny_loaded.tokenizer.stop_token_ids)
        else:
            forced += 1
            runs += not was_forced
        was_forced = ff != []
        assert st.accept(t) and ref.consume_token(t)
    assert st.stopped and forced > 20
    assert counting.runs_computed <= 2 * runs < forced, (counting.runs_computed, runs, forced)
