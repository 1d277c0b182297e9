"""Speculative decoding on a hybrid Mamba model (``tiny-random-mamba-hybrid``, Bamba).

A verification step computes a request's last token and its draft as one extend; a Mamba
layer's state cannot be cut back to fewer positions, so the model stages the step instead of
writing the state (``MambaStatePool.stage``, ``bamba.VerifiedScan``) and the scheduler
settles it at the positions it kept.

* The premise, for this model: the logits at each position of a staged extend (beside a
  prefill chunk of another sequence) are the bits of as many decode steps; the slot is not
  written by the forward; settled at any number of kept positions, the conv and SSM states
  are the bits those decode steps leave.
* The pool's staging protocol: one staged step per slot, settled once; freeing a slot drops
  it; the integrity check sees a step left staged.
* On vs off in the engine: the same tokens, logprobs and top logprobs (bit for bit), greedy
  and seeded sampling, alone and in batches with drafts accepted and rejected (both
  asserted through the counters), with stop tokens and max_tokens cutting drafts short, at
  each kernel ISA level; every step keeps the slot and state-slot invariants; afterwards every
  state snapshot in the tree is the bits a fresh prefill of its path gives (so no rejected
  position reached one) and every state slot not held by a snapshot is free.
* Under memory pressure (retractions), with structured outputs (forced runs and n-gram
  drafts under a grammar) and with ``n > 1`` (a server), the same results on and off.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.memory.mamba import MambaStatePool
from radixserve.model.arch.bamba import VerifiedScan, make_state_pool
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.testing.tiny import tiny_random_config

from cpu_paths import require_kernels
from test_mamba_hybrid import Seqs, make_runner
from test_speculative import bits, grammar_workload, on_off, run

NAME = "tiny-random-mamba-hybrid"
CFG = tiny_random_config("bamba")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, CFG.vocab_size) for _ in range(n)]


# ---------------------------------------------------------------------------------- premise
def test_a_staged_step_settles_to_the_state_of_each_prefix() -> None:
    """A 6-position extend staged beside another sequence's prefill chunk, settled at 1..6
    kept positions: each time, logits and conv/SSM states are the bits of that many decode
    steps from the same state; the forward itself leaves the slot as it was."""
    require_kernels()
    runner = make_runner(slots=8)
    pool = runner.model.states
    prompt, cont, other = _tokens(30, 1), _tokens(6, 2), _tokens(17, 3)
    k = len(cont)
    seqs = Seqs(runner, [len(prompt) + k, len(prompt) + k, len(other)])
    seqs.run({0: (0, prompt), 1: (0, prompt)})
    before = seqs.state_of(0)
    want_logits, want_states = [], []
    for j, t in enumerate(cont):  # seq 1 decodes the continuation one token a step
        want_logits.append(seqs.run({1: (len(prompt) + j, [t])})[1][0])
        want_states.append(seqs.state_of(1))
    slot, company = seqs.state[0], seqs.state[2]
    for rows in range(1, k + 1):
        pool.conv[:, slot].copy_(before[0])
        pool.ssm[:, slot].copy_(before[1])
        pool.zero(company)
        fb = ForwardBatch.build([cont, other], [len(prompt), 0], [seqs.kv[0], seqs.kv[2]],
                                return_all_logits=[True, False])
        fb.state_slots, fb.state_staged = [slot, company], [True, False]
        logits = runner.forward(fb).all_logits[0]
        conv, ssm = seqs.state_of(0)
        assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1]), "the staged forward wrote the slot"
        assert set(pool.staged) == {slot}
        for j in range(k):
            assert torch.equal(bits(logits[j]), bits(want_logits[j])), f"position {j}: extend != decode"
        pool.settle(slot, rows)
        assert not pool.staged
        conv, ssm = seqs.state_of(0)
        assert torch.equal(bits(conv), bits(want_states[rows - 1][0])), f"conv state after {rows} kept rows"
        assert torch.equal(bits(ssm), bits(want_states[rows - 1][1])), f"SSM state after {rows} kept rows"


def test_staging_protocol() -> None:
    """A slot has at most one staged step, settled once; freeing the slot drops it; a step
    cannot keep more positions than it computed."""
    pool: MambaStatePool = make_state_pool(CFG, 3)
    a = pool.alloc()
    with pytest.raises(RuntimeError, match="no staged step"):
        pool.settle(a, 1)
    pool.stage(a, VerifiedScan())
    with pytest.raises(RuntimeError, match="already has a staged step"):
        pool.stage(a, VerifiedScan())
    pool.free(a)
    assert not pool.staged and pool.available == 3
    with pytest.raises(ValueError, match="state slot"):
        pool.stage(7, VerifiedScan())
    runner = make_runner(slots=2)
    seqs = Seqs(runner, [10])
    fb = ForwardBatch.build([_tokens(4, 9)], [0], [seqs.kv[0][:4]])
    fb.state_slots, fb.state_staged = [seqs.state[0]], [True]
    runner.forward(fb)
    with pytest.raises(ValueError, match="keep: 5 rows of a staged step of 4"):
        runner.model.states.settle(seqs.state[0], 5)
    fb.state_staged = [True, False]
    with pytest.raises(ValueError, match="state_staged"):
        runner.forward(fb)


def test_integrity_sees_a_step_left_staged() -> None:
    with Engine(NAME, cache="radix", dtype="float32", kv_cache_tokens=1024) as eng:
        eng.generate(_tokens(12, 4), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        pool = eng.core.states
        slot = pool.alloc()
        pool.stage(slot, VerifiedScan())
        with pytest.raises(AssertionError, match="staged step"):
            eng.check_integrity()
        pool.free(slot)
        eng.check_integrity()


# ---------------------------------------------------------------------------------- on vs off
def check_snapshots_are_fresh_prefills(eng: Engine) -> int:
    """Every state snapshot in the tree is the bits a prefill of its path from the zero state
    gives (no rejected draft position reached it), and every state slot is free or a
    snapshot's. Empties the cache (the prefills need its KV slots). Returns how many
    snapshots were checked."""
    core = eng.core
    assert not eng.has_unfinished()
    pool, tree, runner = core.states, core.cache, core.runner
    snaps = tree.snapshots.slots
    assert pool.available + len(snaps) == pool.capacity and not pool.staged
    kept = []
    for node, slot in snaps.items():
        path = array("I")
        path.frombytes(tree.path_bytes(node))
        kept.append((path.tolist(), pool.conv[:, slot].clone(), pool.ssm[:, slot].clone()))
    assert kept, "no snapshot to check: the test proves nothing"
    assert eng.flush_cache() and pool.available == pool.capacity
    slot = pool.alloc()
    try:
        for path, conv, ssm in kept:
            kv = core.allocator.alloc(len(path))
            try:
                pool.zero(slot)
                fb = ForwardBatch.build([path], [0], [kv])
                fb.state_slots = [slot]
                runner.forward(fb)
            finally:
                core.allocator.free(kv)
            assert torch.equal(pool.conv[:, slot], conv), f"conv snapshot after {len(path)} tokens"
            assert torch.equal(pool.ssm[:, slot], ssm), f"SSM snapshot after {len(path)} tokens"
    finally:
        pool.free(slot)
    return len(kept)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_on_off_identical(dtype: torch.dtype) -> None:
    """The repeating workload of ``test_speculative`` (greedy and seeded, penalties, stop tokens,
    short max_tokens, strangers in the batch, chunked prefills): identical results, drafts
    accepted and rejected, state snapshots untouched by rejected positions."""
    stats = on_off(NAME, dtype, check=check_snapshots_are_fresh_prefills)
    assert stats["mamba_snapshots_taken"] > 0 and stats["mamba_snapshot_hits"] > 0, stats


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_on_off_identical_at_each_isa_level(isa: str) -> None:
    """The kernels around the Mamba layers (linears, norms, attention) at capped ISA levels."""
    on_off(NAME, torch.float32, small=True, cpu_isa=isa, check=check_snapshots_are_fresh_prefills)


def test_on_off_identical_under_memory_pressure() -> None:
    """A KV pool too small for the batch: requests are retracted (their state slot given back,
    their end snapshotted) and resume, with the same results."""
    stats = on_off(NAME, torch.float32, rejections=False, workload_seed="-f", kv_cache_tokens=300,
                   decode_reserve_ratio=0.0, check=check_snapshots_are_fresh_prefills)
    assert stats["retractions"] > 0


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast-forward", "no-fast-forward"])
def test_grammar_requests_on_off_identical(fast_forward: bool) -> None:
    """Schema and regex requests: a grammar's forced runs verified as drafts (up to 32
    positions staged at once) and n-gram drafts under the grammar's constraint."""
    require_kernels()
    batch = grammar_workload(CFG.vocab_size, 11)
    results, stats = [], {}
    for spec in (False, True):
        with Engine(NAME, cache="radix", dtype="float32", kv_cache_tokens=4096, speculative_row_cost=0.0,
                    speculative_pricing="row-cost", speculative="ngram-tree" if spec else "none",
                    grammar_fast_forward=fast_forward) as eng:
            results.append(run(eng, batch, spec, fast_forwards=fast_forward) + run(eng, batch, spec, fast_forwards=fast_forward))
            stats = eng.stats()
            check_snapshots_are_fresh_prefills(eng)
    for i, (x, y) in enumerate(zip(*results)):
        assert x[:3] == y[:3], f"request {i}: tokens, logprobs or top logprobs differ with speculation"
    assert stats["speculative_accepted_tokens"] > 0


def test_server_n_choices_and_logprobs_on_off() -> None:
    """``n > 1`` through the OpenAI server, seeded, with logprobs, asked twice (the second
    time the first answers are in the tree): each choice drafts and keeps its own state; the
    same answers on and off."""
    require_kernels()
    import httpx
    from server_utils import start_server

    body = {"model": NAME, "prompt": _tokens(30, 5), "max_tokens": 16, "n": 3, "temperature": 0.5, "seed": 3,
            "logprobs": 2, "ignore_eos": True}
    got = []
    for spec in ("none", "ngram-tree"):
        url, handle = start_server(NAME, kv_cache_tokens=4096, speculative=spec, speculative_row_cost=0.0,
                                   speculative_pricing="row-cost")
        try:
            answers = [httpx.post(url + "/v1/completions", json=body, timeout=120).json() for _ in range(2)]
            got.append([[(c["text"], c["logprobs"]["token_logprobs"]) for c in a["choices"]] for a in answers])
            accepted = answers[1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
            handle.check_integrity()
        finally:
            handle.stop()
    assert got[0] == got[1]
    assert accepted > 0


def test_a_failed_speculative_step_leaves_no_staged_state() -> None:
    """A step that staged its rows' states and then failed: its requests fail alone, their
    slots go back with the staged steps dropped, the snapshots are untouched, and the same
    request again gives the answer it gives without the failure."""
    require_kernels()
    prompt = _tokens(25, 6)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    with Engine(NAME, cache="radix", dtype="float32", kv_cache_tokens=1024, speculative="ngram-tree",
                speculative_row_cost=0.0, speculative_pricing="row-cost") as eng:
        want = eng.generate(prompt, params)[0]
        pool, snaps = eng.core.states, eng.core.cache.snapshots
        before = {nd: (pool.conv[:, s].clone(), pool.ssm[:, s].clone()) for nd, s in snaps.slots.items()}
        runner = eng.core.runner
        real_run = type(runner).run
        failed = []

        def fail(self, batch, *args):
            out = real_run(self, batch, *args)
            if batch.drafts and any(batch.drafts):
                assert pool.staged
                failed.append(True)
                raise RuntimeError("injected failure after a staged step")
            return out

        runner.run = fail.__get__(runner)
        out = eng.generate(prompt, params)[0]
        assert failed and out.finish_reason == "error" and "injected" in (out.error or "")
        assert not pool.staged
        eng.check_integrity()
        assert set(before) <= set(snaps.slots)  # (the prefill took a branch-point snapshot before the failure)
        for nd, (conv, ssm) in before.items():
            assert torch.equal(pool.conv[:, snaps.slots[nd]], conv) and torch.equal(pool.ssm[:, snaps.slots[nd]], ssm)
        runner.run = real_run.__get__(runner)
        again = eng.generate(prompt, params)[0]
        eng.check_integrity()
        assert again.accepted_draft_tokens > 0
        check_snapshots_are_fresh_prefills(eng)
    assert (again.token_ids, again.logprobs) == (want.token_ids, want.logprobs)
