"""The frontend language with structured outputs: ``gen(regex=...)``, ``gen(json_schema=...)``
on the in-process engine and against a real server (SGLang's own request shape), with
``select`` unchanged beside them."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from radixserve.engine.engine import Engine
from radixserve.lang import EngineBackend, RuntimeEndpoint, function, gen, select
from server_utils import start_server

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@function
def form(s, topic):
    s += "Topic: " + topic + "\nCode: "
    s += gen("code", max_tokens=20, temperature=0.7, regex=r"[A-Z]{2}-[0-9]{3}")
    s += "\nRecord: " + gen("record", max_tokens=40, temperature=0, json_schema=SCHEMA)
    s += "\nVerdict: " + select("verdict", choices=["good", "bad"])


def _check(state) -> None:
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", state["code"]), state["code"]
    jsonschema.validate(json.loads(state["record"]), SCHEMA)
    assert state["verdict"] in ("good", "bad")


def test_engine_backend_gen_with_grammars(tiny_loaded) -> None:
    b = EngineBackend(Engine(tiny_loaded, dtype="float32", kv_cache_tokens=4096))
    try:
        for topic in ("a", "b", "c"):
            _check(form.run(topic=topic, backend=b))
        @function
        def bad(s):
            s += "Q: " + gen("x", regex="([")

        with pytest.raises(ValueError, match="regex"):
            bad.run(backend=b)
    finally:
        b.close()
    with pytest.raises(ValueError, match="at most one"):
        gen("x", regex="a", ebnf='root ::= "a"')


def test_runtime_endpoint_and_sglang_shaped_regex() -> None:
    url, handle = start_server("tiny-random", kv_cache_tokens=8192)
    try:
        backend = RuntimeEndpoint(url)
        _check(form.run(topic="z", backend=backend))
        # What SGLang's frontend sends for gen(regex=...): every SglSamplingParams key.
        full = {"max_new_tokens": 16, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
                "stop_regex": None, "temperature": 0, "top_p": 1.0, "top_k": 1 << 30, "min_p": 0.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
                "regex": r"(cat|dog)s?", "json_schema": None, "skip_special_tokens": True,
                "spaces_between_special_tokens": True}
        r = httpx.post(url + "/generate", json={"text": "Pet:", "sampling_params": full}).json()
        assert re.fullmatch(r"(cat|dog)s?", r["text"]), r
    finally:
        handle.stop()
