"""Hostile and odd requests found by a fuzzer and by client libraries (issue 40), against a
real server over real HTTP connections.

Every bad request gets a 4xx in OpenAI's error shape naming the field; an unexpected
exception is a JSON 500 in the same shape on a connection that stays usable; a stream that
fails ends with an error chunk and ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import Engine
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
