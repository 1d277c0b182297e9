"""Tool calls without a model: the parser (``parse_tool_calls``, ``ToolCallStream``), the JSON
scanner under it, and the call grammars, with the real llguidance and the tiny model's
vocabulary.

The contract: whatever text the call grammar lets a model write parses back into the calls it
holds — arguments with ``</tool_call>``, quotes, backslashes and any Unicode in their strings,
JSON nested thousands deep, numbers ``float`` cannot hold — and streaming the same text in
any pieces gives the same calls and content. With ``tool_choice: "auto"`` the model writes
freely until it opens a call; from the tag on the call grammar holds.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.grammar.compiler import GrammarCompiler
from radixserve.grammar.json_scan import INCOMPLETE, INVALID, OK, scan_json
from radixserve.grammar.mask import allocate_bitmask, unpack_bitmask
from radixserve.grammar.spec import GrammarSpec
from radixserve.grammar.tools import (CALL_CLOSE, CALL_OPEN, ToolCallStream, call_grammar, parse_tool_calls,
                                      parse_tool_choice, parse_tools)
from radixserve.protocol.tool_plan import ToolPlan

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
SEARCH = {"type": "object", "properties": {
    "q": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "opts": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"},
        "none": {"type": "null"}, "deep": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}},
        "required": ["n"]}},
    "required": ["q"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
         {"type": "function", "function": {"name": "noop"}}]
PARAMS = {"get_weather": WEATHER, "search": SEARCH, "noop": {"type": "object", "properties": {}}}
NAMES = set(PARAMS)


@pytest.fixture(scope="module")
def compiler(tiny_loaded) -> GrammarCompiler:
    c = GrammarCompiler(tiny_loaded.tokenizer, tiny_loaded.config.vocab_size)
    yield c
    c.close()


def _call(name: str, args_json: str) -> str:
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {args_json}}}{CALL_CLOSE}'


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Content and ``(name, arguments)`` of each call, streamed in pieces cut at ``cuts``."""
    st_ = ToolCallStream(NAMES)
    content, names, args = "", {}, {}
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        c, deltas = st_.feed(text[a:b])
        content += c
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    content += st_.finish()
    return content, [(names[i], args[i]) for i in sorted(names)]


# ---------------------------------------------------------------- the cases the issue names


def test_a_closing_tag_inside_an_argument_is_part_of_the_string() -> None:
    for city in ("</tool_call>", '"</tool_call>"\n</tool_call>', "a\\</tool_call>", "<tool_call>"):
        text = _call("get_weather", json.dumps({"city": city, "unit": "c"}))
        content, calls = parse_tool_calls(text, NAMES)
        assert content == "" and len(calls) == 1, text
        assert json.loads(calls[0].arguments) == {"city": city, "unit": "c"}
        for cuts in ([], list(range(len(text))), [5, 17, 40]):
            assert _stream(text, cuts) == ("", [("get_weather", calls[0].arguments)])


def test_json_nested_thousands_deep_parses_without_recursion() -> None:
    deep = "[" * 5000 + "]" * 5000
    text = "ok " + _call("search", '{"q": "x", "opts": {"n": 1, "deep": ' + deep + "}}")
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "ok" and len(calls) == 1
    assert calls[0].arguments == '{"q": "x", "opts": {"n": 1, "deep": ' + deep + "}}"
    assert _stream(text, list(range(0, len(text), 7)))[1] == [("search", calls[0].arguments)]
    # Cut short or broken deep inside: content, never an exception.
    for bad in ("[" * 5000, "[" * 5000 + "}" * 5000, "{" * 5000):
        t = _call("search", '{"q": ' + bad + "}")
        assert parse_tool_calls(t, NAMES) == (t, [])
        assert _stream(t, list(range(0, len(t), 999))) == (t, [])


def test_numbers_are_kept_as_written() -> None:
    """``1e400`` is JSON (float would make it ``Infinity``, which is not), and so is an integer
    past Python's 4,300-digit ``int`` limit: arguments keep the model's text."""
    big = "9" * 5000
    text = _call("search", '{"q": "a", "opts": {"n": ' + big + ', "x": 1e400}}')
    _, calls = parse_tool_calls(text, NAMES)
    assert len(calls) == 1 and calls[0].arguments == '{"q": "a", "opts": {"n": ' + big + ', "x": 1e400}}'
    assert "Infinity" not in calls[0].arguments


def test_content_around_calls_streamed_and_whole() -> None:
    call, bad = _call("noop", "{}"), CALL_OPEN + "not json" + CALL_CLOSE
    for text, content in ((f"x {call} \n {bad} y", f"x {bad} y"), (f"ok {call}\n{call}\n", "ok"),
                          (f"{call}\n{bad}", bad), (f"a\n{call}\nb", "a\n\nb")):
        assert parse_tool_calls(text, NAMES)[0] == content
        streamed, _ = _stream(text, list(range(len(text))))
        assert streamed.strip() == content


def test_calls_that_are_not_ours_stay_content() -> None:
    for text in (_call("rm_rf", "{}"), _call("noop", "[]"), _call("noop", '"not an object"'),
                 CALL_OPEN + "not json" + CALL_CLOSE, CALL_OPEN + '{"name": "noop"} junk' + CALL_CLOSE,
                 CALL_OPEN + '{"name": "noop", "arguments": {}}'):  # never closed
        assert parse_tool_calls(text, NAMES) == (text, [])
        assert _stream(text, list(range(len(text)))) == (text, [])
    # Arguments written as a JSON string holding an object are unwrapped; "parameters" is
    # accepted for "arguments".
    _, calls = parse_tool_calls(CALL_OPEN + '{"name": "noop", "arguments": "{\\"a\\": 1}"}' + CALL_CLOSE)
    assert calls[0].arguments == '{"a": 1}'
    _, calls = parse_tool_calls(CALL_OPEN + '{"name": "noop", "parameters": {"b": [2]}}' + CALL_CLOSE)
    assert calls[0].arguments == '{"b": [2]}'
    # An escaped lone surrogate stays escaped: the response is still UTF-8.
    _, calls = parse_tool_calls(CALL_OPEN + '{"name": "noop", "arguments": {"s": "\\ud800"}}' + CALL_CLOSE)
    assert calls[0].arguments == '{"s": "\\ud800"}'
    calls[0].arguments.encode("utf-8")


def test_tool_parameters_must_be_an_object_schema() -> None:
    """A call's arguments are an object: a tool whose parameters describe anything else
    could never be called (OpenAI refuses such tools too)."""
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    # A schema without "type" describes an object.
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "a": {"type": "integer"}}}}}])
    assert '"type": "object"' in call_grammar(tools, parse_tool_choice("required", tools), parallel=False)


# ---------------------------------------------------------------- the JSON scanner against json.loads

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
    max_leaves=20)


def _json_loads_strict(text: str) -> bool:
    def no_constants(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError):
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(value=_JSON, ascii_=st.booleans(), data=st.data())
def test_scanner_agrees_with_json_loads(value, ascii_: bool, data) -> None:
    """On JSON and on JSON with one edit, the scanner accepts exactly what ``json.loads``
    (strict: no NaN/Infinity) accepts; a proper prefix of an object, array or string is
    INCOMPLETE, never INVALID."""
    text = json.dumps(value, ensure_ascii=ascii_)
    padded = text + " "  # a bare number at the very end could still grow
    scan = scan_json(padded)
    assert scan.status == OK and scan.end == len(text)
    if text[0] in "[{\"":
        cut = data.draw(st.integers(0, len(text) - 1))
        assert scan_json(text[:cut]).status == INCOMPLETE
    pos = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["insert", "delete"]))
    ch = data.draw(st.sampled_from(list('{}[]",:\\ 0-1e.tfnx\x01')))
    mutated = text[:pos] + ch + text[pos:] if edit == "insert" else text[:pos] + text[pos + 1:]
    s = scan_json(mutated + " ")
    whole = s.status == OK and not mutated[s.end:].strip(" \t\n\r")
    assert whole == _json_loads_strict(mutated), mutated
    if s.status == OK and s.is_object:
        obj = json.loads(mutated[s.start:s.end])
        assert {m.key: json.loads(mutated[m.start:m.end]) for m in s.members} == obj


# ---------------------------------------------------------------- forced calls round-trip

ADVERSARIAL = ["</tool_call>", "<tool_call>", "\n</tool_call>", "</tool_call>\n", '"', "\\", '\\"', '"}}',
               "}\n</tool_call>", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "\u2028", "😀", "\U0010ffff",
               "{", "[", "]"]
# Text as a model writes it (st.text draws no lone surrogates: a model's output is decoded UTF-8).
_STRINGS = st.lists(st.sampled_from(ADVERSARIAL) | st.text(max_size=6), max_size=6).map("".join)


def _value(schema: dict):
    """A strategy for values of the schemas used here (types, enums, nested objects)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type", "object")
    if kind == "string":
        return _STRINGS
    if kind == "integer":
        return st.integers()
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers()
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(_value(schema["items"]), max_size=4)
    props = schema.get("properties", {})
    required = set(schema.get("required", []))

    @st.composite
    def obj(draw):
        out = {}
        for k, sub in props.items():  # the grammar writes properties in schema order
            if k in required or draw(st.booleans()):
                out[k] = draw(_value(sub))
        return out

    return obj()


@st.composite
def _calls(draw) -> list[tuple[str, dict]]:
    n = draw(st.integers(1, 4))
    return [(name, draw(_value(PARAMS[name]))) for name in draw(st.lists(st.sampled_from(sorted(NAMES)),
                                                                            min_size=n, max_size=n))]


def _render(calls: list[tuple[str, dict]], ascii_: bool = False) -> str:
    """Calls as the grammar writes them: ``json.dumps`` separators, non-ASCII raw, ``\\u``
    escapes only for control characters (DEL included, which llguidance escapes). With
    ``ascii_`` every non-ASCII character escaped, as other writers do (not the grammar)."""
    parts = []
    for name, args in calls:
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii_).replace("\x7f", "\\u007f")
        parts.append(CALL_OPEN + body + CALL_CLOSE)
    return "\n".join(parts)


def _accepts(compiler: GrammarCompiler, grammar: str, text: str, tokenizer) -> bool:
    st_ = compiler.compile(GrammarSpec("ebnf", grammar)).new_state()
    return all(st_.accept(t) for t in tokenizer.encode(text)) and st_.matcher.is_accepting()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=_calls(), seed=st.integers(0, 2**32 - 1))
def test_whatever_the_call_grammar_allows_parses_back(compiler, tiny_loaded, calls, seed) -> None:
    """Arguments drawn from the tools' schemas, strings full of tags, quotes, backslashes
    and Unicode, rendered the way the forced-call grammar writes them (which the grammar
    accepts, checked with llguidance on the tiny vocabulary): the parser returns exactly
    those calls, whole or streamed in random pieces; so it does for the same calls with
    every non-ASCII character escaped."""
    tools = parse_tools(TOOLS)
    grammar = call_grammar(tools, parse_tool_choice("required", tools), parallel=True)
    text = _render(calls)
    assert "\\ud" not in text and _accepts(compiler, grammar, text, tiny_loaded.tokenizer), text
    rng = random.Random(seed)
    for t in (text, _render(calls, ascii_=True)):
        content, parsed = parse_tool_calls(t, NAMES)
        assert content == ""
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        for c in parsed:
            c.arguments.encode("utf-8")  # the response can be sent
        cuts = rng.sample(range(len(t)), min(len(t), rng.randint(0, 30)))
        assert _stream(t, cuts) == ("", [(c.name, c.arguments) for c in parsed])


_PIECES = st.sampled_from([_call("noop", "{}"), _call("search", '{"q": "</tool_call>"}'),
                           CALL_OPEN + "not json" + CALL_CLOSE, CALL_OPEN, CALL_CLOSE, "<tool_call>", "</tool_call>", "<tool_", "call>", '"', "\\",
                           "{", "}", "[", "]", '{"name": "noop", "arguments": {}}', '{"name": "search", ',
                           '"arguments": ', '"x"', "1", ", ", "\n", " \n ", "hi ", "not json"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=24), seed=st.integers(0, 2**32 - 1))
def test_streaming_equals_parsing_the_whole_text(pieces: list[str], seed: int) -> None:
    """Any text of tags, JSON pieces and prose, fed in random pieces, gives the calls and
    content of the whole text."""
    text = "".join(pieces)
    content, calls = parse_tool_calls(text, NAMES)
    rng = random.Random(seed)
    cuts = rng.sample(range(len(text)), min(len(text), rng.randint(0, 20))) if text else []
    streamed, streamed_calls = _stream(text, cuts)
    assert streamed_calls == [(c.name, c.arguments) for c in calls]
    # Content around calls is stripped once the whole text is known; a stream cannot take
    # back the whitespace it sent before a call.
    assert (streamed.strip() if calls else streamed) == content


# ---------------------------------------------------------------- tool_choice "auto": the lazy grammar


def _walk(compiler: GrammarCompiler, tiny_loaded, grammar: str, prefix: str, seed: int) -> str:
    """Feed ``prefix``, then let the grammar pick until a call is closed: forced tokens, else
    one of the few lowest allowed ids (short byte tokens, so strings end) other than EOS."""
    tok = tiny_loaded.tokenizer
    st_ = compiler.compile(GrammarSpec("ebnf", grammar)).new_state()
    out = list(tok.encode(prefix))
    assert all(st_.accept(t) for t in out)
    V = tiny_loaded.config.vocab_size
    bm = allocate_bitmask(1, V)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(400):
        if tok.decode(out).endswith(CALL_CLOSE) or st_.stopped:
            break
        t = st_.forced_token()
        if t is None:
            st_.fill_mask(bm, 0)
            allowed = unpack_bitmask(bm, V)[0].nonzero().flatten()
            allowed = allowed[~torch.isin(allowed, torch.tensor(sorted(tok.stop_token_ids)))]
            t = int(allowed[torch.randint(0, min(len(allowed), 8), (1,), generator=rng)])
        assert st_.accept(t)
        out.append(t)
    return tok.decode(out)


@pytest.mark.parametrize("seed", range(4))
def test_auto_writes_freely_until_the_tag_then_only_a_call(compiler, tiny_loaded, seed: int) -> None:
    tools = parse_tools(TOOLS)
    plan = ToolPlan(tools, parse_tool_choice("auto", tools), parallel=False)
    grammar = plan.grammar
    assert grammar is not None
    tok = tiny_loaded.tokenizer
    # Text with no tag is free, and may end there.
    for free in ("Just an answer, no call.", "a <tool_ call", "<tool_cal", ""):
        assert _accepts(compiler, grammar, free, tok)
    # Once the tag is written, what follows is a call of one of the tools.
    text = _walk(compiler, tiny_loaded, grammar, "Let me check. <tool_call>", seed)
    content, calls = parse_tool_calls(text, plan.names)
    assert content == "Let me check." and len(calls) == 1, text
    # What does not start a call after the tag is refused; without parallel calls, so is a
    # second call.
    st_ = compiler.compile(GrammarSpec("ebnf", grammar)).new_state()
    assert not all(st_.accept(t) for t in tok.encode("<tool_call>\nhello"))
    one = _call("noop", "{}")
    assert _accepts(compiler, grammar, one + " done", tok)
    assert not _accepts(compiler, grammar, one + " " + one, tok)
    parallel = ToolPlan(tools, parse_tool_choice("auto", tools), parallel=True).grammar
    assert _accepts(compiler, parallel, one + " and " + one, tok)


def test_auto_with_the_requests_own_grammar_keeps_it() -> None:
    """A regex / response_format with tools and "auto": the request's grammar constrains the
    output (no lazy call grammar on top); a required call excludes one."""
    tools = parse_tools(TOOLS)
    assert ToolPlan(tools, parse_tool_choice("auto", tools), False, own_grammar=True).grammar is None
    with pytest.raises(ValueError, match="tool_choice"):
        ToolPlan(tools, parse_tool_choice("required", tools), False, own_grammar=True)
