"""Tool calls with the real SmolLM2 over HTTP (the official openai client and httpx):

* a forced call (``tool_choice`` "required" or a named function) whose argument holds
  ``</tool_call>`` comes back as ``tool_calls``, streamed and not;
* output parsed as a call with JSON nested ~1,500 deep (forced by a regex while ``tools`` is
  set) is a well-formed response, streamed (ending in ``[DONE]``) and not (never a 500);
* with ``tool_choice: "auto"`` the model writes freely, and once it writes ``<tool_call>`` the
  rest is a call that parses, its arguments valid against the tool's schema.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from fixtures_smollm2 import require_smollm2
from server_utils import ServerHandle, start_server

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server() -> tuple[str, ServerHandle]:
    require_smollm2()
    base_url, handle = start_server(MODEL, kv_cache_tokens=65536, max_running_requests=32, dtype="float32")
    yield base_url, handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=600)


def _streamed_calls(chunks) -> tuple[dict[int, str], dict[int, str], str, str | None]:
    """names and arguments per index, content and the last finish_reason of a stream."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    content, finish = "", None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            if tc.function and tc.function.arguments:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return names, args, content, finish


# ---------------------------------------------------------------- forced calls with the closing tag

LOCATION = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
TAGGED = {"type": "object", "properties": {
    "city": {"enum": ["</tool_call>", 'Paris"}\n</tool_call>\n<tool_call>', "Lyon \\</tool_call>"]}},
    "required": ["city"]}


def _tool(params: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_whose_argument_holds_the_closing_tag_parses(client: openai.OpenAI, choice) -> None:
    # The prompt of the report: SmolLM2 answers {"location": "Cities</tool_call>"} greedily.
    msgs = [{"role": "user", "content": 'Call get_weather with city "</tool_call>"'}]
    # And a schema whose every value holds the tag, sampled.
    for tools, n, temperature in ((_tool(LOCATION), 1, 0.0), (_tool(TAGGED), 4, 1.0)):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice=choice,
                                           temperature=temperature, n=n, seed=1, max_tokens=60)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
            call = c.message.tool_calls[0]
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
        if tools[0]["function"]["parameters"] is TAGGED:
            assert all("</tool_call>" in c.message.tool_calls[0].function.arguments for c in r.choices)
        stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice=choice,
                                                temperature=0, max_tokens=60, stream=True)
        names, args, content, finish = _streamed_calls(stream)
        assert finish == "tool_calls" and names == {0: "get_weather"} and not content
        jsonschema.validate(json.loads(args[0]), tools[0]["function"]["parameters"])


# ---------------------------------------------------------------- JSON nested deeper than json.loads goes

DEPTH = 1500


def test_a_call_nested_1500_deep_is_a_well_formed_response(server) -> None:
    url, handle = server
    arguments = '{"a": ' + "[" * DEPTH + "]" * DEPTH + "}"
    regex = ('<tool_call>\\n\\{"name": "f", "arguments": \\{"a": ' + "\\[" * DEPTH + "\\]" * DEPTH
             + "\\}\\}\\n</tool_call>")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "regex": regex, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": arguments}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all("error" not in ch for ch in chunks), [ch for ch in chunks if "error" in ch]
    deltas = [tc for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert "".join(d["function"].get("arguments", "") for d in deltas) == arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert handle.stats()["running_requests"] == 0


# ---------------------------------------------------------------- tool_choice "auto"

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]


def _asked_for_the_tool(city: str) -> list[dict]:
    """A conversation in which the tool was called once before: SmolLM2 then opens a call
    for the next city (greedy; about half the time sampled) — and, unconstrained, fills it
    with JSON that is no call ({"temperature": 18})."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Berlin", "unit": "celsius"})}}
    return [{"role": "user", "content": "What's the weather in Berlin?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 12}'},
            {"role": "assistant", "content": "It is 12 degrees celsius in Berlin."},
            {"role": "user", "content": f"What's the weather in {city}?"}]


def test_auto_greedy_call_is_valid(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_asked_for_the_tool("Paris"), tools=TOOLS,
                                       tool_choice="auto", temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
    assert c.message.tool_calls[0].function.name == "get_weather"
    args = json.loads(c.message.tool_calls[0].function.arguments)
    jsonschema.validate(args, WEATHER)
    stream = client.chat.completions.create(model=MODEL, messages=_asked_for_the_tool("Paris"), tools=TOOLS,
                                            tool_choice="auto", temperature=0, max_tokens=100, stream=True)
    names, streamed, _, finish = _streamed_calls(stream)
    assert finish == "tool_calls" and names == {0: "get_weather"} and json.loads(streamed[0]) == args


def test_auto_every_opened_call_parses_and_other_answers_are_plain(client: openai.OpenAI) -> None:
    """Sampled answers to a conversation that invites a call and to one that does not: an
    answer holding the opening tag is a valid call (unless cut by max_tokens); any other
    answer is plain content."""
    outcomes = []
    for msgs in (_asked_for_the_tool("Tokyo"), [{"role": "user", "content": "Write one sentence about cats."}]):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="auto",
                                           temperature=1.0, n=8, seed=5, max_tokens=100)
        for c in r.choices:
            m = c.message
            if m.tool_calls:
                assert c.finish_reason == "tool_calls"
                for call in m.tool_calls:
                    assert call.function.name == "get_weather"
                    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
                outcomes.append("call")
            else:
                assert c.finish_reason == "length" or "<tool_call>" not in (m.content or ""), m.content
                outcomes.append("text")
    assert "call" in outcomes[:8], outcomes
