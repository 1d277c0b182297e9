"""Engine exactness and hits with the real SmolLM2 (float32): reuse must not change a token."""

from __future__ import annotations

import pytest

from radixserve import SamplingParams
from radixserve.engine.engine import Engine

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely. "
    "Facts: the Rhine flows through Switzerland, Germany and the Netherlands; "
    "the Danube flows through Vienna, Budapest and Belgrade. "
)
QUESTIONS = [
    "Which river flows through Vienna?",
    "Name a country the Rhine flows through.",
    "Which river passes Budapest?",
    "Does the Danube flow through Belgrade?",
]


def chat(engine: Engine, q: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
    )
    return engine.tokenizer.encode(text)


@pytest.fixture(scope="module")
def reference(smollm2_loaded):
    eng = Engine(smollm2_loaded, cache="none", dtype="float32", kv_cache_tokens=8192)
    prompts = [chat(eng, q) for q in QUESTIONS]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


def test_radix_equals_no_cache_in_one_batch_and_one_by_one(smollm2_loaded, reference):
    prompts, ref = reference
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    eng = Engine(smollm2_loaded, cache="radix", dtype="float32", kv_cache_tokens=8192)
    batch = eng.generate(prompts, sp)
    assert [o.token_ids for o in batch] == ref
    one = [eng.generate([p], sp)[0] for p in prompts]
    assert [o.token_ids for o in one] == ref
    assert all(o.cached_tokens >= len(p) - 1 for o, p in zip(one, prompts))
    eng.check_integrity()


def test_radix_equals_no_cache_under_eviction_and_retraction(smollm2_loaded, reference):
    prompts, ref = reference
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    longest = max(len(p) for p in prompts)
    eng = Engine(
        smollm2_loaded, cache="radix", dtype="float32",
        kv_cache_tokens=longest + 24, decode_reserve_ratio=0.0,
    )
    outs = eng.generate(prompts, sp)
    s = eng.stats()
    assert s["evicted_tokens"] > 0 and s["retractions"] > 0
    assert [o.token_ids for o in outs] == ref
    eng.check_integrity()
    assert s["protected_tokens"] == 0 or eng.stats()["protected_tokens"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_eight_requests_sharing_a_300_token_prefix_hit_it(smollm2_loaded, page_size):
    eng = Engine(smollm2_loaded, dtype="float32", kv_cache_tokens=8192, page_size=page_size)
    base = ("Here is a long shared context about rivers, cities and mountains of Europe. " * 40)
    prefix = eng.tokenizer.encode(base)[:300]
    assert len(prefix) == 300
    prompts = [prefix + eng.tokenizer.encode(f" Question {i}: what is {i} plus {i}?") for i in range(8)]
    first = eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))[0]
    rest = eng.generate(prompts[1:], SamplingParams(max_tokens=2, temperature=0))
    want = (300 // page_size) * page_size
    assert all(o.cached_tokens >= want for o in rest)
    s = eng.stats()
    outs = [first] + rest
    assert s["prefix_cache_hit_tokens"] == sum(o.cached_tokens for o in outs)
    assert s["prefix_cache_query_tokens"] == sum(len(p) for p in prompts)
    eng.check_integrity()
