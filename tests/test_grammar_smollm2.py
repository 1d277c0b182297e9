"""Structured outputs with the real SmolLM2 over HTTP: 100 objects for each of five schemas
(nested objects, arrays, enums, numbers with ranges, required and optional fields; greedy and
sampled, n = 4, streamed and not) all validate; regex outputs all match; the official openai
client gets parsed tool_calls with tool_choice="required"."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from fixtures_smollm2 import require_smollm2
from server_utils import ServerHandle, start_server

pytestmark = pytest.mark.slow

S = {"type": "string", "maxLength": 20}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": S, "address": {"type": "object", "properties": {"city": S, "country": S},
                                   "required": ["city", "country"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "maxItems": 3}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]},
        "status": {"const": "ok"}},
        "required": ["color", "size", "status"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "temperature": {"type": "number", "minimum": -40, "maximum": 50},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["age", "temperature", "ratio"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {
        "title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 5}, "available": {"type": "boolean"}},
        "required": ["title"], "additionalProperties": False},
}
TOPICS = ["a book", "a city", "a movie", "a friend", "a car", "a song", "a dog", "a phone", "a shop",
          "a river", "a game", "a chef", "a film star", "a planet", "a bridge", "a museum", "a coat",
          "a train", "a painter", "a school", "a lake", "a garden", "a robot", "a cake", "a storm"]


@pytest.fixture(scope="module")
def server() -> tuple[str, ServerHandle]:
    require_smollm2()
    base_url, handle = start_server("smollm2-135m", kv_cache_tokens=65536, max_running_requests=64,
                                    dtype="float32")
    yield base_url, handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=600)


def _msg(topic: str, name: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {topic} as a JSON object ({name})."}]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_hundred_objects_validate(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}

    def sampled(i: int) -> list[str]:  # 4 choices per request, sampled
        r = client.chat.completions.create(model="smollm2-135m", messages=_msg(TOPICS[i], name), n=4,
                                           temperature=0.9, seed=i, max_tokens=200, response_format=rf)
        return [c.message.content for c in r.choices]

    def streamed_greedy(i: int) -> list[str]:
        text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="smollm2-135m", messages=_msg(TOPICS[i], name), temperature=0, max_tokens=200,
            response_format=rf, stream=True) if ch.choices)
        return [text]

    with ThreadPoolExecutor(16) as pool:
        outs = [t for ts in pool.map(sampled, range(24)) for t in ts]
        outs += [t for ts in pool.map(streamed_greedy, range(4)) for t in ts]
    assert len(outs) == 100
    for text in outs:
        jsonschema.validate(json.loads(text), schema)


def test_regex_outputs_all_match(client: openai.OpenAI) -> None:
    pattern = r"(Monday|Tuesday|Friday) at [0-9]{1,2}:[0-5][0-9] (am|pm)"

    def one(i: int) -> list[str]:
        r = client.completions.create(model="smollm2-135m", prompt=f"Meeting {i} is on", max_tokens=30,
                                      temperature=0.8, n=4, seed=i, extra_body={"regex": pattern})
        return [c.text for c in r.choices]

    with ThreadPoolExecutor(8) as pool:
        outs = [t for ts in pool.map(one, range(10)) for t in ts]
    assert len(outs) == 40 and all(re.fullmatch(pattern, t) for t in outs), outs


def test_openai_client_tool_choice_required(client: openai.OpenAI, server) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}}]
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=tools, tool_choice="required",
                                       temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tools[0]["function"]["parameters"])
    # The same, streamed: incremental tool_calls deltas that add up to the same call.
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=tools,
                                                 tool_choice="required", temperature=0, max_tokens=100,
                                                 stream=True))
    streamed = "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                       for tc in (ch.choices[0].delta.tool_calls or []) if tc.function)
    assert json.loads(streamed) == args
    assert server[1].stats()["grammar_forced_tokens"] > 0
