"""Hostile and broken inputs over HTTP while well-formed streams run.

Every case of the table gets its 4xx in OpenAI's error shape (and the expected status);
the eight streams running meanwhile finish with exactly the output of a quiet run; the
engine's invariants hold afterwards. ``python -m pytest tests/test_hostile_inputs.py -s``
prints the table (case, status, message).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from radixserve import Engine
from radixserve.config import ServerConfig
from server_utils import running_server

MODEL = "tiny-random"
BIG = 2**70
MSG = [{"role": "user", "content": "hello"}]
# A template that refuses a leading system message, as many real templates do.
TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
            "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SERVER = ServerConfig(max_prompt_chars=20_000, max_body_bytes=200_000, log_level="warning")

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"


def comp(**kw: object) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw: object) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


def gen(**kw: object) -> dict:
    return {"text": "hi", **kw}


def sp(**kw: object) -> dict:
    return gen(sampling_params={"max_new_tokens": 2, **kw})


# (case, method, path, body (dict, or raw bytes/str), expected status)
CASES: list[tuple[str, str, str, object, int]] = [
    # numerics
    ("rep-penalty-1e-40", "POST", C, comp(repetition_penalty=1e-40, temperature=1), 400),
    ("rep-penalty-0", "POST", C, comp(repetition_penalty=0), 400),
    ("temperature-nan", "POST", C, '{"model":"tiny-random","prompt":"hi","temperature":NaN}', 400),
    ("temperature-inf", "POST", C, '{"model":"tiny-random","prompt":"hi","temperature":Infinity}', 400),
    ("temperature-negative", "POST", C, comp(temperature=-1), 400),
    ("temperature-huge", "POST", C, comp(temperature=1e6), 400),
    ("top-p-zero", "POST", C, comp(top_p=0), 400),
    ("top-p-above-1", "POST", C, comp(top_p=1.5), 400),
    ("top-p-nan", "POST", C, '{"model":"tiny-random","prompt":"hi","top_p":NaN}', 400),
    ("min-p-2", "POST", C, comp(min_p=2), 400),
    ("presence-3", "POST", C, comp(presence_penalty=3), 400),
    ("frequency-minus-5", "POST", C, comp(frequency_penalty=-5), 400),
    ("seed-2**70", "POST", C, comp(seed=BIG), 400),
    ("seed-negative", "POST", C, comp(seed=-1), 400),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-1), 400),
    ("max-tokens-2**70", "POST", C, comp(max_tokens=BIG), 400),
    ("max-tokens-string", "POST", C, comp(max_tokens="5"), 400),
    ("max-tokens-bool", "POST", C, comp(max_tokens=True), 400),
    ("max-tokens-float", "POST", C, comp(max_tokens=1.5), 400),
    ("n-zero", "POST", C, comp(n=0), 400),
    ("n-2**70", "POST", C, comp(n=BIG), 400),
    ("logprobs-21", "POST", C, comp(logprobs=21), 400),
    ("over-context", "POST", C, comp(prompt=[5] * 3000), 400),
    # prompts
    ("lone-surrogate-prompt", "POST", C, '{"model":"tiny-random","prompt":"a\\ud800b"}', 400),
    ("empty-prompt", "POST", C, comp(prompt=""), 400),
    ("empty-prompt-list", "POST", C, comp(prompt=[]), 400),
    ("empty-nested-prompt", "POST", C, comp(prompt=[[]]), 400),
    ("token-out-of-vocab", "POST", C, comp(prompt=[1, 2, 10**6]), 400),
    ("token-negative", "POST", C, comp(prompt=[1, -2]), 400),
    ("prompt-int", "POST", C, comp(prompt=5), 400),
    ("prompt-null", "POST", C, comp(prompt=None), 400),
    ("prompt-object", "POST", C, comp(prompt={"a": 1}), 400),
    ("prompt-too-many-chars", "POST", C, comp(prompt="x" * 30_000), 400),
    ("too-many-prompts", "POST", C, comp(prompt=["a"] * 65), 400),
    ("too-many-choices", "POST", C, comp(prompt=["a"] * 10, n=20), 400),
    # stops
    ("stop-17-strings", "POST", C, comp(stop=[f"s{i}" for i in range(17)]), 400),
    ("stop-string-too-long", "POST", C, comp(stop=["x" * 300]), 400),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400),
    ("stop-int", "POST", C, comp(stop=5), 400),
    ("stop-lone-surrogate", "POST", C, '{"model":"tiny-random","prompt":"hi","stop":["\\udfff"]}', 400),
    ("stop-ids-65", "POST", C, comp(stop_token_ids=list(range(65))), 400),
    ("stop-ids-negative", "POST", C, comp(stop_token_ids=[-1]), 400),
    ("stop-ids-strings", "POST", C, comp(stop_token_ids=["a"]), 400),
    # unknown or unsupported fields
    ("unknown-field-typo", "POST", C, comp(max_token=5), 400),
    ("unknown-field", "POST", C, comp(foo=1), 400),
    ("wrong-model", "POST", C, comp(model="gpt-4"), 400),
    ("logit-bias", "POST", C, comp(logit_bias={"5": 1.0}), 400),
    ("suffix", "POST", C, comp(suffix="x"), 400),
    ("best-of", "POST", C, comp(best_of=3), 400),
    ("echo-string", "POST", C, comp(echo="yes"), 400),
    ("stream-string", "POST", C, comp(stream="true"), 400),
    ("stream-options-bad", "POST", C, comp(stream=True, stream_options={"include_usage": "x"}), 400),
    ("cache-salt-empty", "POST", C, comp(cache_salt=""), 400),
    ("cache-salt-int", "POST", C, comp(cache_salt=5), 400),
    # bodies
    ("body-not-json", "POST", C, "{not json", 400),
    ("body-array", "POST", C, "[1, 2]", 400),
    ("body-empty", "POST", C, "", 400),
    ("body-oversize", "POST", C, comp(prompt="x" * 300_000), 413),
    # chat
    ("chat-no-messages", "POST", CH, chat(messages=[]), 400),
    ("chat-messages-string", "POST", CH, chat(messages="hi"), 400),
    ("chat-missing-role", "POST", CH, chat(messages=[{"content": "x"}]), 400),
    ("chat-lone-surrogate", "POST", CH, '{"model":"tiny-random","messages":[{"role":"user","content":"\\ud800"}]}', 400),
    ("chat-image-part", "POST", CH, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400),
    ("chat-tools", "POST", CH, chat(tools=[{"type": "function"}]), 400),
    ("chat-template-raises", "POST", CH, chat(messages=[{"role": "system", "content": "x"}, *MSG]), 400),
    ("chat-max-tokens-0", "POST", CH, chat(max_tokens=0), 400),
    ("chat-top-logprobs-without-logprobs", "POST", CH, chat(top_logprobs=3), 400),
    ("chat-top-logprobs-21", "POST", CH, chat(logprobs=True, top_logprobs=21), 400),
    ("chat-json-format-unknown", "POST", CH, chat(response_format={"type": "xml"}), 400),
    ("chat-json-schema-invalid", "POST", CH, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}), 400),
    ("chat-tool-choice-unknown-name", "POST", CH, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), 400),
    ("chat-n-200", "POST", CH, chat(n=200), 400),
    ("chat-too-long", "POST", CH, chat(messages=[{"role": "user", "content": "x" * 30_000}]), 400),
    # native
    ("gen-both-inputs", "POST", G, {"text": "a", "input_ids": [1, 2]}, 400),
    ("gen-no-input", "POST", G, {"sampling_params": {"max_new_tokens": 2}}, 400),
    ("gen-unknown-param", "POST", G, sp(bogus=1), 400),
    ("gen-regex-invalid", "POST", G, sp(regex="[0-9"), 400),
    ("gen-regex-and-ebnf", "POST", G, sp(regex="a", ebnf='root ::= "a"'), 400),
    ("gen-max-new-negative", "POST", G, sp(max_new_tokens=-3), 400),
    ("gen-seed-2**70", "POST", G, sp(seed=BIG), 400),
    ("gen-rep-penalty-0", "POST", G, sp(repetition_penalty=0), 400),
    ("gen-stops-20", "POST", G, sp(stop=[f"s{i}" for i in range(20)]), 400),
    ("gen-lone-surrogate", "POST", G, '{"text":"\\ud800"}', 400),
    ("gen-empty-ids", "POST", G, {"input_ids": [[]]}, 400),
    ("gen-ids-out-of-vocab", "POST", G, {"input_ids": [10**6]}, 400),
    ("gen-batch-mismatch", "POST", G, {"text": ["a", "b"], "return_logprob": [True]}, 400),
    ("gen-params-list-single", "POST", G, {"text": "a", "sampling_params": [{}]}, 400),
    ("gen-n-0", "POST", G, sp(n=0), 400),
    ("gen-rid-int", "POST", G, gen(rid=5), 400),
    ("gen-top-logprobs-50", "POST", G, gen(return_logprob=True, top_logprobs_num=50), 400),
    ("gen-image", "POST", G, gen(image_data="x"), 400),
    ("gen-lora", "POST", G, gen(lora_path="x"), 400),
    ("gen-unknown-nested-param", "POST", G, sp(max_new_token=3), 400),
    # routes
    ("flush-get", "GET", "/flush_cache", None, 405),
    ("flush-while-busy", "POST", "/flush_cache", {}, 400),
    ("flush-bad-body", "POST", "/flush_cache", '{"empty_cache": "yes"', 400),
    ("abort-no-rid", "POST", "/abort_request", {}, 400),
    ("abort-rid-int", "POST", "/abort_request", {"rid": 5}, 400),
    ("completions-get", "GET", C, None, 405),
    ("unknown-route", "POST", "/v1/embeddings", {"input": "x"}, 404),
]

# Accepted and harmless: a huge top_k is clamped to the vocabulary.
ACCEPTED = [
    ("top-k-2**70", "POST", C, comp(top_k=BIG, temperature=1, seed=1), 200),
    ("top-k-5-beside-it", "POST", C, comp(top_k=5, temperature=1, seed=2), 200),
]

STREAM_PROMPTS = [f"stream {i} " + "abc " * (i + 1) for i in range(8)]  # short: 1900 tokens fit
STREAM_BODY = {"model": MODEL, "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, progress: list[int]) -> tuple[str, float]:
    """The streamed text; ``progress[0]`` counts the chunks received so far."""
    text = ""
    async with client.stream("POST", url + C, json={**STREAM_BODY, "prompt": prompt}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                obj = json.loads(line[5:])
                assert "error" not in obj, obj
                text += obj["choices"][0]["text"]
                progress[0] += 1
    return text, asyncio.get_running_loop().time()


async def _case(client: httpx.AsyncClient, url: str, method: str, path: str, body: object) -> httpx.Response:
    if body is None:
        return await client.request(method, url + path)
    if isinstance(body, (str, bytes)):
        return await client.request(method, url + path, content=body,
                                    headers={"Content-Type": "application/json"})
    return await client.request(method, url + path, json=body)


def test_hostile_inputs_while_streams_run() -> None:
    engine = Engine(MODEL, dtype="float32", kv_cache_tokens=16384)
    engine.tokenizer.chat_template = TEMPLATE
    with running_server(engine=engine, server=SERVER) as (url, handle):
        quiet = [httpx.post(url + C, json={**STREAM_BODY, "prompt": p, "stream": False}, timeout=60)
                 .json()["choices"][0]["text"] for p in STREAM_PROMPTS]
        handle.wait_idle()

        async def run() -> tuple[list, list, list[bool]]:
            async with httpx.AsyncClient(timeout=60) as client:
                streams: list[tuple[int, list[int], asyncio.Task]] = []

                async def top_up() -> None:
                    # Whatever this CPU's speed, every case meets at least 4 streams that are
                    # under way at the server (a chunk received) and far from their end.
                    def fresh(p: list[int], t: asyncio.Task) -> bool:
                        return not t.done() and p[0] < STREAM_BODY["max_tokens"] // 2

                    new = []
                    while sum(fresh(p, t) for _, p, t in streams) < 4:
                        i = len(streams) % len(STREAM_PROMPTS)
                        prog = [0]
                        streams.append((i, prog, asyncio.create_task(_stream(client, url, STREAM_PROMPTS[i], prog))))
                        new.append(streams[-1])
                    while any(p[0] == 0 and not t.done() for _, p, t in new):
                        await asyncio.sleep(0.005)

                results = []
                overlapped: list[bool] = []
                for case in CASES + ACCEPTED:
                    await top_up()
                    results.append((case, await _case(client, url, *case[1:4])))
                    overlapped.append(any(not t.done() for _, _, t in streams))
                outs = await asyncio.gather(*(t for _, _, t in streams))
                return [(i, text) for (i, _, _), (text, _) in zip(streams, outs)], results, overlapped

        stream_out, results, overlapped = asyncio.run(run())
        rows = []
        for (name, _, path, _, want), resp in results:
            msg = ""
            if resp.status_code >= 400:
                err = resp.json().get("error")
                assert isinstance(err, dict) and err.get("message"), (name, resp.text)
                assert set(err) >= {"message", "type", "param", "code"}, (name, err)
                msg = err["message"]
            rows.append((name, resp.status_code, msg))
            assert resp.status_code == want, (name, resp.status_code, resp.text[:300])
        print("\n| case | status | message |\n|---|---:|---|")
        for name, status, msg in rows:
            print(f"| {name} | {status} | {msg[:110]} |")
        assert len(CASES) >= 60
        # Every case ran while streams ran, and the streams are unchanged by them.
        assert all(text == quiet[i] for i, text in stream_out)
        assert all(overlapped), ([r[0][0] for r, o in zip(results, overlapped) if not o], len(stream_out))
        handle.wait_idle()
        handle.check_integrity()
        s = handle.stats()
        assert s["protected_tokens"] == 0 and s["private_tokens"] == 0
        ok = httpx.post(url + C, json=comp(), timeout=30)
        assert ok.status_code == 200


@pytest.mark.parametrize("name", ["field-named"])
def test_errors_name_the_field(name: str) -> None:
    engine = Engine(MODEL, dtype="float32", kv_cache_tokens=4096)
    with running_server(engine=engine) as (url, _):
        for body, param in [(comp(top_p=1.5), "top_p"), (comp(seed=BIG), "seed"),
                            (comp(temperature=-1), "temperature"), (comp(max_token=3), "max_token"),
                            (sp(seed=BIG), "sampling_params.seed")]:
            path = G if "text" in body else C
            err = httpx.post(url + path, json=body, timeout=30).json()["error"]
            assert err["param"] == param or param in err["message"], (body, err)
