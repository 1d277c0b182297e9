"""Structured outputs in the engine core (tiny random model, real llguidance): masks only on
grammar rows, grammar end -> "stop", fast-forward equal to one-token-per-step decoding token
for token, n > 1, streaming, retraction, and bad grammars refused before they are queued."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from radixserve import SamplingParams
from radixserve.engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "identifier_of_the_record": {"type": "integer", "minimum": 0, "maximum": 999},
        "category_of_the_record": {"enum": ["alpha", "beta", "gamma"]},
        "short_label": {"type": "string", "maxLength": 6},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["identifier_of_the_record", "category_of_the_record", "short_label", "flags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no) [0-9]{2,4}-[a-f]{3}"


def make_engine(tiny_loaded, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("dtype", "float32")
    return Engine(tiny_loaded, **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def _params(temperature: float, n: int, **grammar) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=120, temperature=temperature, seed=100 + i, **grammar) for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("grammar", [{"json_schema": SCHEMA}, {"regex": REGEX}], ids=["json", "regex"])
def test_fast_forward_equals_plain_constrained_decoding(tiny_loaded, temperature, grammar):
    prompts = _prompts(6)
    params = _params(temperature, 6, **grammar)
    plain = make_engine(tiny_loaded, grammar_fast_forward=False)
    ref = plain.generate(prompts, params)
    fast = make_engine(tiny_loaded)
    got = fast.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "stop" for o in got), [o.finish_reason for o in got]
    for o in got:
        if "regex" in grammar:
            assert re.fullmatch(REGEX, o.text), o.text
        else:
            jsonschema.validate(json.loads(o.text), SCHEMA)
    sf, sp = fast.stats(), plain.stats()
    assert sf["grammar_forced_tokens"] > 0 and sp["grammar_forced_tokens"] == 0
    assert sf["steps"] < sp["steps"]  # forced tokens rode along instead of taking steps
    fast.check_integrity()


def test_unconstrained_rows_are_untouched_by_grammar_rows(tiny_loaded):
    prompts = _prompts(8, seed=3)
    free = [SamplingParams(max_tokens=24, temperature=t, seed=7 + i, ignore_eos=True)
            for i, t in enumerate([0.0, 0.8] * 4)]
    alone = make_engine(tiny_loaded).generate(prompts, free)
    mixed_eng = make_engine(tiny_loaded)
    mixed = mixed_eng.generate(prompts + prompts, free + _params(0.7, 8, json_schema=SCHEMA))
    assert [o.token_ids for o in mixed[:8]] == [o.token_ids for o in alone]
    for o in mixed[8:]:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_n_copies_share_one_compiled_grammar_and_stream(tiny_loaded):
    eng = make_engine(tiny_loaded)
    outs = eng.generate([_prompts(1)[0]] * 4, _params(1.0, 4, regex=REGEX))
    assert all(re.fullmatch(REGEX, o.text) for o in outs)
    assert eng.stats()["grammars_compiled"] == 1
    text, finals = "", []
    for o in eng.stream(_prompts(1, 9)[0], SamplingParams(max_tokens=60, temperature=0, regex=REGEX)):
        text += o.delta_text
        if o.finished:
            finals.append(o)
    assert re.fullmatch(REGEX, text) and finals[0].finish_reason == "stop"


def test_max_tokens_cuts_a_grammar_with_length(tiny_loaded):
    eng = make_engine(tiny_loaded)
    out = eng.generate(_prompts(1)[0], SamplingParams(max_tokens=3, temperature=0, json_schema=SCHEMA))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_retraction_keeps_grammar_state_in_step(tiny_loaded):
    prompts = _prompts(10, seed=5)
    params = _params(0.0, 10, json_schema=SCHEMA)
    ref = make_engine(tiny_loaded, cache="none", kv_cache_tokens=8192).generate(prompts, params)
    eng = make_engine(tiny_loaded, kv_cache_tokens=300, decode_reserve_ratio=0.0)
    outs = eng.generate(prompts, params)
    assert eng.stats()["retractions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    eng.check_integrity()


def test_bad_grammar_refused_before_queueing(tiny_loaded):
    eng = make_engine(tiny_loaded)
    with pytest.raises(ValueError, match="regex"):
        eng.add_request([5, 6, 7], SamplingParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="Unsatisfiable"):
        eng.add_request([5, 6, 7], SamplingParams(json_schema={"type": "integer", "minimum": 3, "maximum": 1}))
    assert not eng.has_unfinished() and not eng.core.requests


def test_core_compiles_off_the_loop_and_fails_alone(tiny_loaded):
    """The core itself never compiles in its step: a request waits outside the scheduler
    while its grammar compiles, and one whose grammar fails ends alone with the reason."""
    eng = make_engine(tiny_loaded)
    core = eng.core
    core.add_request("bad", [5, 6], SamplingParams(max_tokens=8, regex="[z-a]"))
    core.add_request("good", [5, 6], SamplingParams(max_tokens=30, temperature=0, regex="ok[0-9]"))
    core.add_request("free", [5, 6], SamplingParams(max_tokens=4, temperature=0))
    core.add_request("gone", [5, 7], SamplingParams(max_tokens=4, regex="abc+d"))
    core.abort("gone")
    done = {}
    for _ in range(200):
        for d in core.step():
            if d.finished:
                done[d.rid] = d
        if not core.has_unfinished():
            break
    assert done["bad"].finish_reason == "error" and "regex" in done["bad"].error
    assert done["good"].finish_reason == "stop"
    assert done["free"].finish_reason == "length" and done["gone"].finish_reason == "abort"
    core.check_integrity()
