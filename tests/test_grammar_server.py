"""Structured outputs over HTTP (real uvicorn server, tiny random model, official openai
client): response_format, SGLang's regex / json_schema / ebnf, tools with tool_choice,
streamed tool_calls deltas, and 400s that name the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_utils import ServerHandle, start_server

MODEL = "tiny-random"
SCHEMA = {"type": "object", "properties": {"code": {"type": "integer", "minimum": 1, "maximum": 50},
                                           "tag": {"enum": ["x", "y"]}},
          "required": ["code", "tag"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> tuple[str, ServerHandle]:
    base_url, handle = start_server(MODEL, kv_cache_tokens=16384, max_running_requests=32)
    yield base_url, handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


def test_response_format_json_schema_chat_and_stream(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60, n=3, temperature=1.0,
                                       seed=1, response_format=rf)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop"
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=60, temperature=0, response_format=rf, stream=True)
        if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_completions_regex(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=0.5, n=2,
                                  extra_body={"regex": "(red|blue)-[0-9]{3}"})
    assert all(re.fullmatch("(red|blue)-[0-9]{3}", x.text) for x in c.choices)


def test_native_generate_grammars(server) -> None:
    url, handle = server
    for sp, check in [
        ({"regex": "[a-c]{2}[0-9]"}, lambda t: re.fullmatch("[a-c]{2}[0-9]", t)),
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"ebnf": 'root ::= "A" ("B" | "C")+ "."'}, lambda t: re.fullmatch("A[BC]+[.]", t)),
    ]:
        r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, **sp}}, timeout=60).json()
        assert check(r["text"]), r
        assert r["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    with httpx.stream("POST", url + "/generate", json={"text": "x", "stream": True, "sampling_params": {
            "max_new_tokens": 20, "regex": "[0-9]{4}"}}, timeout=60) as resp:
        lines = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    assert re.fullmatch("[0-9]{4}", lines[-1]["text"])
    handle.check_integrity()


def test_tool_choice_required_gives_parsed_tool_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0.8, n=2, seed=3)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(args, schema)
    named = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"


def test_tool_calls_stream_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=0, stream=True)
    names, args, finish = {}, {}, None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            if tc.function and tc.function.arguments:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names and set(names) == set(args)
    assert isinstance(json.loads(args[0]), dict)


def test_tool_choice_auto_and_none_answer_normally(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=choice,
                                           max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "if": {}}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"regex": "[^\\x00-\\U0010ffff]"}, "regex"),
])
def test_bad_grammars_are_400_naming_the_field(server, body, param) -> None:
    url, handle = server
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"regex": "(("}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex"
    assert handle.stats()["running_requests"] == 0
