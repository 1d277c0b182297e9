"""Bad input never gives a 500: each request of the table is answered 4xx in OpenAI's error
shape, and the server still serves a good request afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server_utils import ServerHandle, start_server

MODEL = "tiny-random"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> tuple[str, ServerHandle]:
    base_url, handle = start_server(MODEL, kv_cache_tokens=4096)
    yield base_url, handle
    handle.stop()


# (id, path, body (dict = JSON, bytes = raw), expected status)
BAD: list[tuple[str, str, Any, int]] = [
    ("malformed-json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400),
    ("body-not-object", "/v1/completions", [1, 2, 3], 400),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL}, 400),
    ("empty-messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("messages-wrong-type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    ("content-wrong-type", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ("image-content", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("unknown-model", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 400),
    ("negative-max-tokens", "/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": -1}, 400),
    ("zero-max-tokens-chat", "/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400),
    ("absurd-max-tokens", "/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 10**9}, 400),
    ("max-tokens-string", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400),
    ("max-tokens-bool", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400),
    ("negative-temperature", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("top-p-zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
    ("penalty-out-of-range", "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 3}, 400),
    ("n-zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400),
    ("too-many-top-logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400),
    ("top-logprobs-without-logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400),
    ("empty-prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("empty-prompt-list", "/v1/completions", {"model": MODEL, "prompt": []}, 400),
    ("token-id-out-of-vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400),
    ("negative-token-id", "/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400),
    ("prompt-over-context", "/v1/completions", {"model": MODEL, "prompt": [5] * 3000, "max_tokens": 1}, 400),
    ("empty-stop-string", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400),
    ("logit-bias", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1.0}}, 400),
    ("stream-over-context", "/v1/chat/completions",
     {"model": MODEL, "messages": MSG, "max_tokens": 5000, "stream": True}, 400),
    ("generate-no-input", "/generate", {"sampling_params": {"max_new_tokens": 2}}, 400),
    ("generate-both-inputs", "/generate", {"text": "a", "input_ids": [1, 2]}, 400),
    ("generate-bad-param", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": -3}}, 400),
    ("generate-unknown-param", "/generate", {"text": "a", "sampling_params": {"bogus": 1}}, 400),
    ("generate-regex-invalid", "/generate", {"text": "a", "sampling_params": {"regex": "(["}}, 400),
    ("generate-regex-empty-language", "/generate",
     {"text": "a", "sampling_params": {"regex": "[^\\x00-\\U0010ffff]"}}, 400),
    ("generate-batch-mismatch", "/generate", {"text": ["a", "b"], "return_logprob": [True]}, 400),
    ("flush-bad-body", "/flush_cache", b'{"empty_cache": "yes"', 400),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404),
]


@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(server: tuple[str, ServerHandle], path: str, body: Any, status: int) -> None:
    url, _ = server
    if isinstance(body, bytes):
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "not_found_error")


def test_messages_name_the_field(server: tuple[str, ServerHandle]) -> None:
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": -1})
    assert "temperature" in r.json()["error"]["message"]
    # A wrong role type is reported with the path of the field.
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": 3, "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 3000})
    assert "context length" in r.json()["error"]["message"]


def test_server_still_serves_after_bad_requests(server: tuple[str, ServerHandle]) -> None:
    url, handle = server
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    stats = handle.wait_idle()
    assert stats["protected_tokens"] == 0
    handle.check_integrity()
