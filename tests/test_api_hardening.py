"""Hostile and odd requests found by a fuzzer and by client libraries (issue 40), against a
real server over real HTTP connections.

Every bad request gets a 4xx in OpenAI's error shape naming the field; an unexpected
exception is a JSON 500 in the same shape on a connection that stays usable; a stream that
fails ends with an error chunk and ``[DONE]``.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import Engine
from radixserve.config import ServerConfig
from server_utils import ServerHandle, running_server

MODEL = "tiny-random"
CH, G = "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerHandle]]:
    engine = Engine(MODEL, dtype="float32", kv_cache_tokens=8192)
    with running_server(engine=engine) as (url, handle):
        yield url, handle


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, "temperature": 0, **kw}


def local_port(r: httpx.Response) -> int:
    """The client-side port of the connection that carried ``r``: equal ports on one
    client mean the connection was kept and reused."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def sse_events(r: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in r.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err
    return err


# --------------------------------------------------------------------------- internal errors
def _inject_fault(monkeypatch: pytest.MonkeyPatch, handle: ServerHandle) -> None:
    """A bug after generation: rendering the logprobs of a chat answer raises."""

    def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(handle.app.state.server.texts, "chat_entries", boom)


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_usable(
        server: tuple[str, ServerHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    url, handle = server
    with httpx.Client(base_url=url, timeout=60) as client:
        first = client.post(CH, json=chat())
        assert first.status_code == 200, first.text
        _inject_fault(monkeypatch, handle)
        bad = client.post(CH, json=chat(logprobs=True))
        err = assert_error(bad, 500)
        assert err["type"] == "server_error" and "RuntimeError" in err["message"]
        monkeypatch.undo()
        again = client.post(CH, json=chat())
        assert again.status_code == 200, again.text
        # One connection carried all three: the 500 did not close it.
        assert local_port(first) == local_port(bad) == local_port(again)
    handle.wait_idle()
    handle.check_integrity()


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_chunk_and_done(
        server: tuple[str, ServerHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    url, handle = server
    with httpx.Client(base_url=url, timeout=60) as client:
        _inject_fault(monkeypatch, handle)
        with client.stream("POST", CH, json=chat(logprobs=True, stream=True, max_tokens=50,
                                                  ignore_eos=True)) as r:
            assert r.status_code == 200
            events = sse_events(r)
            port = local_port(r)
        monkeypatch.undo()
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["type"] == "server_error" and err["code"] == 500 and "RuntimeError" in err["message"]
        again = client.post(CH, json=chat())
        assert again.status_code == 200 and local_port(again) == port
    handle.wait_idle()  # the stream's request was aborted, not left running
    handle.check_integrity()


# --------------------------------------------------------------------------- bad input: 4xx, not 500
DEEP = "[" * 3000 + "]" * 3000  # deeper than Python's json module can parse
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _history(tool_calls: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": tool_calls},
            {"role": "user", "content": "ok"}]


def _deep_call() -> list[dict[str, Any]]:
    return [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]


def _gen_sp(**kw: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **kw}}


# (case, path, body (dict, or raw JSON text), status, the field the error names)
BAD_INPUT: list[tuple[str, str, Any, int, str]] = [
    ("gen-stop-int", G, _gen_sp(stop=5), 400, "sampling_params.stop"),
    ("gen-stop-bool", G, _gen_sp(stop=True), 400, "sampling_params.stop"),
    ("gen-stop-ids-int", G, _gen_sp(stop_token_ids=5), 400, "sampling_params.stop_token_ids"),
    ("gen-stop-ids-bool", G, _gen_sp(stop_token_ids=False), 400, "sampling_params.stop_token_ids"),
    ("gen-json-schema-text-too-deep", G, _gen_sp(json_schema=DEEP), 400, "sampling_params.json_schema"),
    ("gen-json-schema-text-too-deep-inside", G,
     _gen_sp(json_schema='{"type": "object", "properties": {"a": ' + DEEP + "}}"), 400, "sampling_params.json_schema"),
    ("gen-rid-lone-surrogate-stream", G,
     '{"text": "hi", "rid": "a\\ud800", "stream": true, "sampling_params": {"max_new_tokens": 2}}', 400, "rid"),
    ("gen-rid-lone-surrogate", G, '{"text": "hi", "rid": "a\\ud800", "sampling_params": {"max_new_tokens": 2}}',
     400, "rid"),
    ("gen-rid-list-lone-surrogate", G, '{"text": ["a", "b"], "rid": ["x", "\\udfff"]}', 400, "rid[1]"),
    ("chat-history-tool-args-too-deep", CH, chat(messages=_history(_deep_call())), 400,
     "messages.1.tool_calls.0.function.arguments"),
    ("chat-history-tool-args-too-deep-tools", CH, chat(messages=_history(_deep_call()), tools=TOOLS), 400,
     "messages.1.tool_calls.0.function.arguments"),
    ("chat-history-tool-calls-int", CH, chat(messages=_history(5)), 400, "messages.1.tool_calls"),
    ("chat-history-tool-calls-int-tools", CH, chat(messages=_history(5), tools=TOOLS), 400, "messages.1.tool_calls"),
    ("chat-history-tool-call-function-str", CH, chat(messages=_history([{"function": "x"}]), tools=TOOLS), 400,
     "messages.1.tool_calls.0.function"),
    ("chat-history-tool-call-no-name", CH, chat(messages=_history([{"function": {"arguments": "{}"}}]), tools=TOOLS),
     400, "messages.1.tool_calls.0.function.name"),
    ("chat-role-unknown", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("chat-temperature-bool", CH, chat(temperature=True), 400, "temperature"),
    ("chat-top-p-bool", CH, chat(top_p=True), 400, "top_p"),
    ("chat-presence-penalty-string", CH, chat(presence_penalty="0.5"), 400, "presence_penalty"),
    ("completions-frequency-penalty-bool", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 2, "frequency_penalty": False}, 400, "frequency_penalty"),
    ("completions-min-p-bool", "/v1/completions", {"model": MODEL, "prompt": "hi", "min_p": True}, 400, "min_p"),
    ("completions-repetition-penalty-bool", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "repetition_penalty": True}, 400, "repetition_penalty"),
    ("gen-temperature-bool", G, _gen_sp(temperature=True), 400, "sampling_params.temperature"),
    ("open-session-timeout-bool", "/open_session", {"timeout": True}, 400, "timeout"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_4xx_naming_the_field(server: tuple[str, ServerHandle], path: str, body: Any,
                                             status: int, param: str) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as client:
        if isinstance(body, str):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert_error(r, status, param)
        assert client.post(CH, json=chat()).status_code == 200  # the same connection, still usable


def test_numbers_are_still_numbers(server: tuple[str, ServerHandle]) -> None:
    """Integers are fine where a float is expected (temperature 1, as JSON clients send it)."""
    url, _ = server
    r = httpx.post(url + CH, json=chat(temperature=1, top_p=1, presence_penalty=0, seed=3), timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url + G, json=_gen_sp(temperature=1, top_p=1), timeout=60)
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- logprobs and content
END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # tiny-random's end-of-turn / end-of-text tokens


def _seeds_that_end_the_turn(url: str, path: str, body: dict[str, Any], want: int = 3) -> list[dict[str, Any]]:
    """Non-streamed answers (seeded, so reproducible) that the model ended itself with an
    end-of-turn token: a random model does so now and then."""
    found = []
    for seed in range(200):
        r = httpx.post(url + path, json={**body, "seed": seed}, timeout=60).json()
        if r["choices"][0]["finish_reason"] == "stop":
            found.append({"seed": seed, "response": r})
            if len(found) == want:
                break
    assert len(found) == want, found
    return found


def test_chat_logprobs_have_no_entry_for_the_end_of_turn_token(server: tuple[str, ServerHandle]) -> None:
    """The end-of-turn token is not in ``content`` (as in vLLM and OpenAI), so ``logprobs`` has
    no entry for it either; ``usage.completion_tokens`` still counts it, as vLLM's does (its
    usage counts every token the model generated, the stop token included)."""
    url, _ = server
    body = chat(max_tokens=48, temperature=1.0, logprobs=True, top_logprobs=2)
    for hit in _seeds_that_end_the_turn(url, CH, body):
        r = hit["response"]
        entries = r["choices"][0]["logprobs"]["content"]
        assert entries and entries[-1]["token"] not in END_TOKENS, entries[-1]
        assert len(entries) == r["usage"]["completion_tokens"] - 1
        # Streamed, the same answer carries the same entries.
        with httpx.stream("POST", url + CH, json={**body, "seed": hit["seed"], "stream": True,
                                                  "stream_options": {"include_usage": True}}, timeout=60) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]"
        streamed = [e for ev in events[:-1] for c in ev["choices"] if c.get("logprobs")
                    for e in c["logprobs"]["content"]]
        text = "".join(c["delta"].get("content") or "" for ev in events[:-1] for c in ev["choices"])
        assert streamed == entries and text == r["choices"][0]["message"]["content"]
        assert events[-2]["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]


def test_completion_logprobs_have_no_entry_for_the_end_token(server: tuple[str, ServerHandle]) -> None:
    url, _ = server
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 48, "temperature": 1.0, "logprobs": 2}
    for hit in _seeds_that_end_the_turn(url, "/v1/completions", body):
        r = hit["response"]
        lp = r["choices"][0]["logprobs"]
        assert lp["tokens"] and lp["tokens"][-1] not in END_TOKENS, lp["tokens"][-1]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(lp["top_logprobs"])
        assert len(lp["tokens"]) == r["usage"]["completion_tokens"] - 1


# --------------------------------------------------------------------------- grammars
EXPLODING = "(a{1000}){1000}"  # compiles, then exceeds llguidance's lexer limits at its first step
EXPLODING_LATER = "[xy]{8}(a{1000}){1000}"  # the same, a few tokens in


def test_a_grammar_beyond_the_parser_limits_at_its_first_step_is_refused_up_front(
        server: tuple[str, ServerHandle]) -> None:
    url, handle = server
    before = handle.stats()["grammars_compiled"]
    assert_error(httpx.post(url + G, json=_gen_sp(regex=EXPLODING, max_new_tokens=8), timeout=60), 400,
                 "sampling_params.regex")
    assert_error(httpx.post(url + CH, json=chat(regex=EXPLODING), timeout=60), 400, "regex")
    assert handle.stats()["grammars_compiled"] == before  # refused before anything was queued


def test_a_grammar_that_fails_mid_generation_is_an_error_never_a_success(server: tuple[str, ServerHandle]) -> None:
    """Past the check, a grammar can still hit the parser's limits some tokens in; that request
    fails — and so does every later one with the same grammar (llguidance shares the failed
    lexer between copies), instead of ending with an empty "stop" as if it had matched."""
    url, handle = server
    for _ in range(3):
        r = httpx.post(url + G, json=_gen_sp(regex=EXPLODING_LATER, max_new_tokens=16, temperature=0), timeout=60)
        err = assert_error(r, 400)
        assert err["code"] == "request_failed" and "grammar" in err["message"], err
        with httpx.stream("POST", url + CH, json=chat(regex=EXPLODING_LATER, stream=True, max_tokens=16),
                          timeout=60) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert not any(c.get("finish_reason") == "stop" for ev in events[:-1] if isinstance(ev, dict)
                       for c in ev.get("choices", ())), events
    handle.wait_idle()
    handle.check_integrity()


def _wide_schema(n: int, tag: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{tag}{i}": {} for i in range(n)}}


def test_a_schema_with_too_many_properties_is_refused_before_it_is_compiled(
        server: tuple[str, ServerHandle]) -> None:
    """Compile cost grows with the square of an object's properties: past the documented limit
    (2,000 properties) the schema is refused without compiling anything, wherever it comes
    from. Below it a schema is served."""
    url, handle = server
    srv = handle.app.state.server
    compiled, core_compiled = srv.grammars_compiled, handle.stats()["grammars_compiled"]
    nested = {"type": "object", "properties": {f"o{j}": _wide_schema(100) for j in range(21)}}  # 2,121
    cases = [
        (G, _gen_sp(json_schema=json.dumps(_wide_schema(2001))), "sampling_params.json_schema"),
        (G, _gen_sp(json_schema=nested), "sampling_params.json_schema"),
        (CH, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _wide_schema(2001)}}),
         "response_format.json_schema.schema"),
        (CH, chat(tools=[{"type": "function", "function": {"name": f"f{k}", "parameters": _wide_schema(700, f"t{k}")}}
                         for k in range(3)], tool_choice="required"), "tools"),
    ]
    for path, body, param in cases:
        err = assert_error(httpx.post(url + path, json=body, timeout=60), 400, param)
        assert "2000" in err["message"].replace(",", ""), err
    assert srv.grammars_compiled == compiled and handle.stats()["grammars_compiled"] == core_compiled
    ok = httpx.post(url + G, json=_gen_sp(json_schema=_wide_schema(300), max_new_tokens=4), timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_full_server_answers_429_before_compiling_a_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(MODEL, dtype="float32", kv_cache_tokens=4096, max_running_requests=1)
    # The engine holds its one running request until released: the server stays full.
    release = threading.Event()
    real_run = engine.core.runner.run

    def held_run(*args: Any, **kwargs: Any) -> Any:
        release.wait(60)
        return real_run(*args, **kwargs)

    with running_server(engine=engine, server=ServerConfig(max_queued_requests=0, log_level="warning")) as (url, handle):
        monkeypatch.setattr(engine.core.runner, "run", held_run)
        srv = handle.app.state.server
        try:
            with httpx.Client(base_url=url, timeout=60) as client, \
                    client.stream("POST", G, json={"text": "hi", "stream": True,
                                                   "sampling_params": {"max_new_tokens": 4}}) as busy:
                assert busy.status_code == 200  # submitted: the one slot is taken
                compiled = srv.grammars_compiled
                for k in range(3):
                    r = httpx.post(url + G, json=_gen_sp(json_schema=_wide_schema(50, f"k{k}_")), timeout=60)
                    assert_error(r, 429)
                    assert r.headers.get("retry-after")
                assert srv.grammars_compiled == compiled  # nothing compiled for requests it could not take
                release.set()
                assert sse_events(busy)[-1] == "[DONE]"
        finally:
            release.set()
        handle.wait_idle()


# --------------------------------------------------------------------------- request bodies
SMALL_BODY = 100_000


@pytest.fixture(scope="module")
def strict_server() -> Iterator[tuple[str, ServerHandle]]:
    engine = Engine(MODEL, dtype="float32", kv_cache_tokens=4096)
    cfg = ServerConfig(max_body_bytes=SMALL_BODY, body_read_timeout_s=1.0, log_level="warning")
    with running_server(engine=engine, server=cfg) as (url, handle):
        yield url, handle


def _raw_exchange(url: str, head: bytes, chunks: Iterator[bytes] = iter(()), wait_s: float = 20.0) -> bytes:
    """Send ``head`` then ``chunks`` on a plain socket, stopping as soon as the server
    answers (a server that refuses a body does not read the rest of it); returns what the
    server sent until it closed the connection or ``wait_s`` passed (a guard against a hang)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(head)
        for chunk in chunks:
            if select.select([s], [], [], 0.01)[0]:
                break
            try:
                s.sendall(chunk)
            except OSError:  # the server closed it: its answer is in the socket
                break
        out = b""
        try:
            while data := s.recv(65536):
                out += data
        except TimeoutError:
            pass
        return out


def _status_and_json(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), raw[:200]
    return int(head.split()[1]), json.loads(body)


def test_a_chunked_body_over_the_limit_is_413(strict_server: tuple[str, ServerHandle]) -> None:
    url, _ = strict_server
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    chunks = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(800))  # 50 MB
    status, body = _status_and_json(_raw_exchange(url, head, chunks))
    assert status == 413 and body["error"]["code"] == "body_too_large", body
    # Within the limit, a chunked body is read as any other.
    ok = httpx.post(url + CH, content=(json.dumps(chat()).encode(),), headers={"Content-Type": "application/json"},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_body_that_never_comes_is_408(strict_server: tuple[str, ServerHandle]) -> None:
    url, handle = strict_server
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\": ")
    raw = _raw_exchange(url, head)  # then nothing: the body is announced, never sent
    status, body = _status_and_json(raw)
    assert status == 408 and body["error"]["code"] == "body_timeout", body
    assert b"connection: close" in raw.lower().partition(b"\r\n\r\n")[0]
    assert httpx.post(url + CH, json=chat(), timeout=60).status_code == 200
    handle.check_integrity()


# --------------------------------------------------------------------------- the OpenAPI document
def test_the_openapi_document_says_what_the_server_answers(server: tuple[str, ServerHandle]) -> None:
    url, _ = server
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns (in this process) about duplicate operation ids
        doc = httpx.get(url + "/openapi.json", timeout=60).json()
    schemas = doc["components"]["schemas"]
    err = schemas["ErrorResponse"]
    assert set(err["properties"]["error"]["properties"]) >= {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), ids
    with_body = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (path, method)
            if "requestBody" in op:
                with_body.append((path, method))
                bad = op["responses"]["400"]["content"]["application/json"]["schema"]
                assert bad == {"$ref": "#/components/schemas/ErrorResponse"}, (path, method)
    assert ("/v1/chat/completions", "post") in with_body and ("/generate", "post") in with_body
    # What it documents is what it does: a body of the wrong shape is a 400 in that shape.
    for path, method in with_body:
        r = httpx.request(method.upper(), url + path, json=[1], timeout=60)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, (path, r.text)
    # /health answers an empty 200 (or a 503 in the error shape), not JSON.
    health = doc["paths"]["/health"]["get"]["responses"]
    assert "application/json" not in health["200"].get("content", {}), health
    assert health["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    r = httpx.get(url + "/health", timeout=60)
    assert r.status_code == 200 and r.content == b""
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"], metrics
    # The cache hint header the routes read by hand is documented where it is read, and a value
    # outside what the document allows is the 400 it promises, naming the header.
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        names = [p["name"] for p in doc["paths"][path]["post"].get("parameters", []) if p["in"] == "header"]
        assert "X-Cache-Low-Priority-From" in names, (path, names)
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                   headers={"X-Cache-Low-Priority-From": "-1"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Cache-Low-Priority-From", r.text
