"""OpenAI's Predicted Outputs (``prediction``) as a draft source of speculative decoding, through
the official ``openai`` client against a real server with the real SmolLM2.

* The same answer (text and logprobs) with and without a prediction, greedy and seeded,
  ``n = 2``, on ``/v1/chat/completions`` and ``/v1/completions``, the prediction as text or as
  a list of text parts.
* A prediction that is the answer gets drafted from: ``accepted_prediction_tokens`` > 0. Each
  predicted request runs under a ``cache_salt`` of its own, so the tree (which holds the
  earlier answer under another salt) cannot be what drafted it.
* Bad shapes are 400s in OpenAI's error shape naming the field; without ``--speculative`` a
  prediction is accepted and drafts nothing.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from cpu_paths import require_kernels
from fixtures_smollm2 import require_smollm2
from server_utils import ServerHandle, start_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "List the four seasons of the year, one per line, and say one thing "
             "about each."}]


@pytest.fixture(scope="module")
def server() -> tuple[str, ServerHandle]:
    require_smollm2()
    require_kernels()
    url, handle = start_server("smollm2-135m", kv_cache_tokens=16384, speculative="ngram-tree",
                               speculative_pricing="row-cost")
    yield url, handle
    handle.stop()


def _chat(client: openai.OpenAI, salt: str, prediction: object = None, **kw: object):
    args: dict = {"model": "smollm2-135m", "messages": MESSAGES, "max_tokens": 64, "temperature": 0,
                  "logprobs": True, "extra_body": {"cache_salt": salt}}
    args.update(kw)
    if prediction is not None:
        args["prediction"] = prediction
    return client.chat.completions.create(**args)


def _answer(resp) -> list[tuple[str, list[float]]]:
    return [(c.message.content, [t.logprob for t in c.logprobs.content]) for c in resp.choices]


def test_prediction_drafts_without_changing_the_answer(server: tuple[str, ServerHandle]) -> None:
    url, handle = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    plain = _chat(client, "plain")
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens >= 20, text

    predicted = _chat(client, "predicted", {"type": "content", "content": text})
    assert _answer(predicted) == _answer(plain)
    details = predicted.usage.completion_tokens_details
    # The answer is the prediction: nearly every token after the first is drafted and kept.
    assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens // 2, details

    half = len(text) // 2
    parts = _chat(client, "parts", {"type": "content", "content": [{"type": "text", "text": text[:half]},
                                                                  {"type": "text", "text": text[half:]}]})
    assert _answer(parts) == _answer(plain)
    assert parts.usage.completion_tokens_details.accepted_prediction_tokens > 0

    # A prediction that is not the answer changes nothing either.
    wrong = _chat(client, "wrong", {"type": "content", "content": "Completely unrelated text about ships. " * 4})
    assert _answer(wrong) == _answer(plain)

    # Seeded sampling, two choices: the same draws with and without the prediction.
    seeded = {"temperature": 0.8, "seed": 11, "n": 2}
    a = _chat(client, "seeded-a", **seeded)
    b = _chat(client, "seeded-b", {"type": "content", "content": a.choices[0].message.content}, **seeded)
    assert _answer(a) == _answer(b)
    assert b.usage.completion_tokens_details.accepted_prediction_tokens > 0
    handle.check_integrity()


def test_prediction_on_completions(server: tuple[str, ServerHandle]) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    args = {"model": "smollm2-135m", "prompt": "The capital cities of France, Spain and Italy are", "max_tokens": 40,
            "temperature": 0, "logprobs": 1}
    plain = client.completions.create(**args, extra_body={"cache_salt": "c-plain"})
    text = plain.choices[0].text
    predicted = client.completions.create(**args, extra_body={
        "cache_salt": "c-predicted", "prediction": {"type": "content", "content": text}})
    assert predicted.choices[0].text == text
    assert predicted.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("prediction,param", [
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "prediction.content"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
    ("just text", "prediction"),
])
def test_bad_predictions_are_400s_naming_the_field(server: tuple[str, ServerHandle], prediction: object,
                                                   param: str) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "bad", prediction, max_tokens=4)
    err = info.value.body
    err = err.get("error", err) if isinstance(err, dict) else err
    assert err["param"].startswith(param) and err["type"] == "invalid_request_error", err
    r = httpx.post(url + "/v1/completions", timeout=30, json={
        "model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2, "prediction": prediction})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_prediction_without_speculation_is_accepted_and_drafts_nothing() -> None:
    require_kernels()
    url, handle = start_server("tiny-random", kv_cache_tokens=4096)
    try:
        body = {"model": "tiny-random", "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        text = plain["choices"][0]["text"]
        got = httpx.post(url + "/v1/completions", timeout=30, json={
            **body, "prediction": {"type": "content", "content": text}}).json()
        assert got["choices"][0]["text"] == text
        assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    finally:
        handle.stop()
