"""``serve --dp 2`` with a hybrid Mamba model (``tiny-random-mamba-hybrid``): each core has its
own tree of attention KV and state snapshots, and the API process routes by its event-fed
mirrors of them, which know where the snapshots are.

Conversations behind shared system prompts, one request at a time (each routed once the
mirrors have every event of the one before): a follow-up turn goes to the core holding the
previous turn's snapshot and resumes there; what the mirror predicted a core serves is
exactly what it served, also where the core's KV reaches further than its deepest snapshot;
outputs equal the in-process engine without a cache.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from server_utils import running_server
from test_dp_hybrid import MAX_NEW, _count_stored, _gen, _record_picks, _wait_mirrors

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig, ServerConfig

CFG = EngineConfig(model="tiny-random-mamba-hybrid", dtype="float32", kv_cache_tokens=4096, num_threads=1)


def _conversations(seed: int, n: int, turns: int) -> list[list[list[int]]]:
    """``n`` conversations of ``turns`` prompts, two behind each of ``n // 2`` system prompts;
    a turn's prompt is the previous one, its greedy answer (from the engine without a
    cache) and new tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(30)] for _ in range(n // 2)]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    convs = [[systems[i // 2] + [rng.randrange(3, 500) for _ in range(rng.randint(5, 12))]] for i in range(n)]
    with Engine(config=dataclasses.replace(CFG, cache="none")) as eng:
        for _ in range(turns - 1):
            outs = eng.generate([c[-1] for c in convs], params)
            for c, o in zip(convs, outs):
                c.append(c[-1] + o.token_ids + [rng.randrange(3, 500) for _ in range(rng.randint(4, 9))])
    return convs


@pytest.mark.parametrize("speculative", ["none", "ngram-tree"])
def test_dp_routes_follow_up_turns_to_their_snapshot(speculative: str):
    """With ``--speculative ngram-tree`` too: a verification step's rejected positions never
    reach a snapshot, so never a ``state_stored`` event, and the mirrors predict what the
    cores serve just the same."""
    convs = _conversations(0, n=4, turns=3)
    engine = dataclasses.replace(CFG, speculative=speculative, speculative_row_cost=0.0, speculative_pricing="row-cost")
    with running_server(engine=engine, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        picks = _record_picks(handle)
        stored = _count_stored(handle)
        _wait_mirrors(handle, stored)
        outs: list[list[dict]] = [[] for _ in convs]
        order = [(t, i) for t in range(3) for i in range(len(convs))]
        for t, i in order:
            outs[i].append(_gen(url, convs[i][t]))
            _wait_mirrors(handle, stored)
        by_turn = {key: p for key, p in zip(order, picks, strict=True)}
        for (t, i), p in by_turn.items():
            o = outs[i][t]["meta_info"]
            assert p["synced"]
            assert p["served"][p["core"]] == o["cached_tokens"], (t, i, p, o)
            if t:
                # The previous turn's snapshot: all of it but its last sampled token.
                prev = len(convs[i][t - 1]) + MAX_NEW - 1
                assert o["cached_tokens"] == prev, (t, i, o)
                assert p["core"] == by_turn[(t - 1, i)]["core"], (t, i, p)
        # Each conversation's answers are those of the engine without a cache.
        for i, c in enumerate(convs):
            for t in range(2):
                assert c[t + 1][: len(c[t]) + MAX_NEW] == c[t] + outs[i][t]["output_ids"], (i, t)
        # Routing met a core whose KV reaches past its deepest snapshot (a second
        # conversation behind a system prompt) and predicted what it serves, not the KV.
        assert any(p["full"][p["core"]] > p["served"][p["core"]] for p in picks), picks
        assert {p["core"] for p in picks} == {0, 1}
        for w in handle.client.dispatcher.workers:
            st = w.mirror.status
            assert (st.resyncs, st.gaps, st.mismatches) == (0, 0, 0), st
            assert w.mirror.states and w.mirror.tree().states
        stats = handle.stats()
        assert stats["dp_size"] == 2 and stats["mamba_snapshot_hits"] >= 8
        if speculative != "none":  # each last turn again: drafted from the tree's copy of its answer
            for i, c in enumerate(convs):
                again = _gen(url, c[2])
                _wait_mirrors(handle, stored)
                assert again["output_ids"] == outs[i][2]["output_ids"], i
            for w in handle.client.dispatcher.workers:
                assert w.mirror.status.mismatches == 0
            assert handle.stats()["speculative_accepted_tokens"] > 0
            handle.check_integrity()
        handle.check_integrity()
