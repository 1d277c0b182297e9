"""The benchmark harness: workload generators, offline optimum, and a quick end-to-end run.

End-to-end runs use the tiny random model with shrunken sizes so the suite stays fast.
"""

from __future__ import annotations

import json
import math

import pytest

from radixserve.bench.metrics import (
    RequestRecord,
    RunResult,
    offline_optimal_hit_rate,
    percentile,
    summarize,
    trie_nodes,
)
from radixserve.bench.workloads import WORKLOADS, drive, make_workload


@pytest.fixture(scope="module")
def tok(tiny_loaded):
    return tiny_loaded.tokenizer


def _echo(reqs):
    return {r.id: f" out-{r.id}" for r in reqs}


# ----------------------------------------------------------------------------- optimum


def _naive_trie(seqs):
    root: dict = {}
    n = 0
    for s in seqs:
        node = root
        for t in s:
            if t not in node:
                node[t] = {}
                n += 1
            node = node[t]
    return n


def test_trie_nodes_small_cases():
    assert trie_nodes([]) == 0
    assert trie_nodes([[1, 2, 3]]) == 3
    assert trie_nodes([[1, 2, 3], [1, 2, 3]]) == 3  # duplicates are free
    assert trie_nodes([[1, 2, 3], [1, 2, 4]]) == 4
    assert trie_nodes([[1, 2], [1, 2, 3]]) == 3  # a prefix of another
    assert trie_nodes([[5], [1, 2], [1, 3, 4]]) == 5


def test_trie_nodes_matches_naive_trie():
    import random

    rng = random.Random(0)
    for _ in range(50):
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 8))] for _ in range(rng.randrange(1, 12))]
        assert trie_nodes(seqs) == _naive_trie(seqs)


def test_offline_optimal_hit_rate():
    prefix = list(range(100))
    seqs = [prefix + [1000 + i] for i in range(10)]
    # 100 shared + 10 distinct nodes over 1010 prompt tokens.
    assert offline_optimal_hit_rate(seqs) == pytest.approx(1 - 110 / 1010)
    assert offline_optimal_hit_rate([[1, 2], [3, 4]]) == 0.0
    assert offline_optimal_hit_rate([]) == 0.0


def test_percentile_and_summary():
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    recs = [RequestRecord(f"r{i}", 0, 10, 5, 1, 0.0, 0.1 * (i + 1), 0.2 * (i + 1),
                          prompt_token_ids=[1] * 5 + [i] * 5) for i in range(4)]
    s = summarize(RunResult("w", {"cache": "radix", "policy": "lpm"}, recs, 2.0,
                            {"tree_seconds": 0.02}))
    assert s["hit_rate"] == pytest.approx(0.5)
    assert s["requests_per_s"] == pytest.approx(2.0)
    assert s["tree_share"] == pytest.approx(0.01)
    assert s["ttft_p50"] == pytest.approx(0.25)
    assert s["optimal_hit_rate"] == pytest.approx(1 - (5 + 4 * 5) / 40)


# ----------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_are_seeded_and_reproducible(name, tok):
    a = drive(make_workload(name, tok, seed=1), _echo)
    b = drive(make_workload(name, tok, seed=1), _echo)
    c = drive(make_workload(name, tok, seed=2), _echo)
    assert a == b
    assert a != c
    assert all(r and all(q.prompt and q.max_tokens >= 1 for q in r) for r in a)
    ids = [q.id for r in a for q in r]
    assert len(ids) == len(set(ids))


def test_few_shot_shape(tok):
    (reqs,) = drive(make_workload("few-shot", tok, num_questions=6, shots=3, prefix_tokens=200,
                                  question_tokens=20), _echo)
    assert len(reqs) == 6 and all(r.max_tokens == 1 for r in reqs)
    ids = [tok.encode(r.prompt) for r in reqs]
    assert len({r.prompt for r in reqs}) == 6
    shared = min(len(_lcp(ids[0], x)) for x in ids[1:])
    assert 150 <= shared <= 350  # the k-shot prefix, near its token budget
    assert offline_optimal_hit_rate(ids) > 0.5


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_two_level_shape(tok):
    (reqs,) = drive(make_workload("two-level", tok, num_contexts=3, endings=4), _echo)
    assert len(reqs) == 12
    # Endings of one context share context; different contexts share only the few-shot prefix.
    p = [r.prompt for r in reqs]
    assert len(_lcp(p[0], p[1])) > len(_lcp(p[0], p[4])) > 0


def test_multi_turn_rounds_carry_history(tok):
    for output, lo, hi in (("short", 4, 8), ("long", 256, 256)):
        rounds = drive(make_workload(f"multi-turn-{output}", tok, num_conversations=3, turns=3), _echo)
        assert [len(r) for r in rounds] == [3, 3, 3]
        assert all(lo <= q.max_tokens <= hi for r in rounds for q in r)
        for t in (1, 2):
            for i in range(3):
                prev = rounds[t - 1][i]
                cur = rounds[t][i]
                assert cur.prompt.startswith(prev.prompt + f" out-{prev.id}")
                assert cur.round == t


def test_self_consistency_shape(tok):
    (reqs,) = drive(make_workload("self-consistency", tok, samples=5), _echo)
    assert len(reqs) == 5 and len({r.prompt for r in reqs}) == 1
    assert len({r.seed for r in reqs}) == 5 and all(r.temperature > 0 for r in reqs)


def test_tree_of_thought_shape(tok):
    rounds = drive(make_workload("tree-of-thought", tok, branching=3, depth=3), _echo)
    assert [len(r) for r in rounds] == [3, 9, 27]
    parents = {r.id: r for r in rounds[1]}
    for child in rounds[2]:
        parent = parents[child.id.rsplit("-", 1)[0]]
        assert child.prompt.startswith(parent.prompt + f" out-{parent.id}")


def test_agent_and_gsp_shapes(tok):
    rounds = drive(make_workload("agent", tok, num_agents=2, steps=3), _echo)
    assert [len(r) for r in rounds] == [2, 2, 2]
    assert rounds[2][0].prompt.startswith(rounds[1][0].prompt.removesuffix("Thought:"))
    (gsp,) = drive(make_workload("gsp", tok, groups=3, prompts_per_group=4, system_tokens=64,
                                 question_tokens=16, max_tokens=4), _echo)
    assert len(gsp) == 12 and all(r.max_tokens == 4 for r in gsp)
    ids = [tok.encode(r.prompt) for r in gsp]
    # 3 distinct system prompts: optimum ~ 1 - (3*64 + 12*16) / (12*80).
    assert offline_optimal_hit_rate(ids) == pytest.approx(1 - (3 * 64 + 12 * 16) / (12 * 80), abs=0.08)


def test_sharegpt_has_no_deliberate_sharing(tok):
    (reqs,) = drive(make_workload("sharegpt", tok, num_requests=16, max_prompt_tokens=64), _echo)
    assert len(reqs) == 16
    assert offline_optimal_hit_rate([tok.encode(r.prompt) for r in reqs]) < 0.2


def test_unknown_workload_and_params():
    with pytest.raises(ValueError):
        make_workload("nope")
    with pytest.raises(ValueError):
        make_workload("few-shot", bogus=1)


# ----------------------------------------------------------------------------- end to end

_SMALL = ["--param", "few-shot.num_questions=4", "--param", "few-shot.prefix_tokens=120",
          "--param", "gsp.prompts_per_group=3", "--param", "gsp.system_tokens=64",
          "--param", "gsp.max_tokens=3"]


def test_quick_offline_tiny(tmp_path, capsys):
    from radixserve.bench.cli import main

    rc = main(["--quick", "--model", "tiny-random", "--output-dir", str(tmp_path),
               "--cache-sizes", "1024", "--no-progress", *_SMALL])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| few-shot | radix/lpm |" in out and "| gsp | none/lpm |" in out
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {(s["workload"], s["label"], s["tag"]): s for s in data["summaries"]}
    radix = rows[("few-shot", "radix/lpm", "main")]
    none = rows[("few-shot", "none/lpm", "main")]
    assert radix["requests"] == 4 and radix["errors"] == 0
    assert radix["hit_rate"] > 0.3 and none["hit_rate"] == 0
    assert radix["optimal_hit_rate"] == pytest.approx(none["optimal_hit_rate"])
    assert 0 < radix["hit_ratio_of_optimum"] <= 1.0 + 1e-9
    assert radix["computed_tokens"] < none["computed_tokens"]
    assert ("gsp", "radix/lpm", "sweep") in rows
    for png in ("throughput.png", "ttft.png", "hit_rate_vs_cache_size.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_offline_dependent_rounds_reuse_cache(tiny_loaded):
    from radixserve import Engine
    from radixserve.bench.offline import run_offline

    eng = Engine(tiny_loaded, dtype="float32", kv_cache_tokens=4096)
    wl = make_workload("multi-turn-short", tiny_loaded.tokenizer, num_conversations=2, turns=2,
                       turn_tokens=24)
    run = run_offline(eng, wl, {"cache": "radix", "policy": "lpm"})
    assert len(run.records) == 4
    second = [r for r in run.records if r.round == 1]
    assert all(r.cached_tokens > 0 for r in second)
    eng.check_integrity()


def test_online_against_real_server(tiny_loaded):
    server_utils = pytest.importorskip("server_utils")
    from radixserve.bench.online import run_online

    wl = make_workload("few-shot", tiny_loaded.tokenizer, num_questions=3, prefix_tokens=100,
                       question_tokens=16)
    with server_utils.running_server("tiny-random", kv_cache_tokens=4096) as (url, _handle):
        run = run_online(wl, url, "tiny-random", request_rate=50.0, seed=0,
                         tokenize=tiny_loaded.tokenizer.encode)
    s = summarize(run)
    assert s["errors"] == 0, [r.error for r in run.records]
    assert s["requests"] == 3 and s["completion_tokens"] == 3
    assert s["prompt_tokens"] > 0 and not math.isnan(s["ttft_p50"])
    assert s["optimal_hit_rate"] > 0.3
    # The server really reused the shared prefix (at rate 50/s the three questions overlap,
    # so the later ones hit what the first computed).
    assert s["hit_rate"] > 0.3 and s["hit_ratio_of_optimum"] > 0.5


def test_transformers_baseline_same_weights(tiny_loaded):
    """The --engine transformers baseline runs our weights: greedy output equals the engine's."""
    pytest.importorskip("transformers")
    import torch

    from radixserve import Engine, SamplingParams
    from radixserve.bench.offline import load_transformers_model, run_transformers

    ids = tiny_loaded.tokenizer.encode("hello world, this is a test of the model")
    eng = Engine(tiny_loaded, dtype="float32", kv_cache_tokens=2048)
    ours = eng.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    hf = load_transformers_model(tiny_loaded)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out[0, len(ids):].tolist() == ours.token_ids
    wl = make_workload("few-shot", tiny_loaded.tokenizer, num_questions=2, prefix_tokens=60,
                       question_tokens=8)
    s = summarize(run_transformers(tiny_loaded, wl, hf))
    assert s["requests"] == 2 and s["hit_rate"] == 0 and s["optimal_hit_rate"] > 0


def test_memory_pressure_and_branching_shapes(tiny_loaded):
    tok = tiny_loaded.tokenizer
    mp = next(make_workload("memory-pressure", tok, num_systems=4, system_tokens=60, questions=3,
                            question_tokens=8).rounds())
    assert len(mp) == 12 and len({r.prompt.split("\n")[0] for r in mp}) == 4
    assert [r.id for r in mp] != sorted(r.id for r in mp)  # shuffled
    assert all(r.round == 0 for r in mp)
    # order="rounds": one question per system prompt per round, the same 12 requests in all
    rounds = drive(make_workload("memory-pressure", tok, num_systems=4, system_tokens=60, questions=3,
                                 question_tokens=8, order="rounds"), _echo)
    assert len(rounds) == 3
    for q, rnd in enumerate(rounds):
        assert sorted(r.id for r in rnd) == [f"mp-{g}-{q}" for g in range(4)]
        assert len({r.prompt.split("\n")[0] for r in rnd}) == 4 and all(r.round == q for r in rnd)
    flat = {r.id: r.prompt for rnd in rounds for r in rnd}
    assert flat == {r.id: r.prompt for r in mp}  # same prompts as the shuffled order, nothing lost
    assert any([r.id for r in rnd] != sorted(r.id for r in rnd) for rnd in rounds)  # shuffled within
    with pytest.raises(ValueError):
        make_workload("memory-pressure", tok, num_systems=2, order="sorted")
    br = next(make_workload("branching", tok, branching=2, depth=3, root_tokens=20).rounds())
    assert len(br) == 4 + 8  # nodes at depths 2 and 3
    ids = [tok.encode(r.prompt) for r in br]
    assert offline_optimal_hit_rate(ids) > 0.5
