"""``serve --dp 2 --speculative ngram-tree``: each engine core drafts from its own tree with its
own speculator, and the API process routes by its event-fed mirrors of those trees.

Prompts asked once, then again (greedy, and seeded at a low temperature), one request at a
time, each routed once the mirrors hold every event of the one before: the repeat goes to
the core whose tree holds the first answer and drafts it from there; every output equals the
in-process engine's without speculation; what a mirror predicted its core serves is what the
core served (a rejected draft position never reaches a tree, so never an event); the mirrors
saw no gap, mismatch or resync. A third round with logprobs: the same logprob bits as
without speculation.
"""

from __future__ import annotations

import dataclasses
import random
import struct

import httpx
from cpu_paths import require_kernels
from server_utils import running_server
from test_dp_hybrid import _count_stored, _record_picks, _wait_mirrors

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig, ServerConfig

CFG = EngineConfig(model="tiny-random", dtype="float32", kv_cache_tokens=4096, num_threads=1)
MAX_NEW = 16


def _params(i: int) -> dict:
    """Greedy for even ``i``, seeded at a low temperature (answers that loop: drafts partly
    accepted) for odd ones; logprobs always."""
    sp: dict = {"max_new_tokens": MAX_NEW, "ignore_eos": True}
    sp.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.3, "seed": 40 + i})
    return sp


def _gen(url: str, ids: list[int], sp: dict, logprobs: bool = False) -> dict:
    body: dict = {"input_ids": ids, "sampling_params": sp}
    if logprobs:
        body["return_logprob"] = True
    r = httpx.post(url + "/generate", timeout=60, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _bits(lps: list[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in lps]


def test_dp_speculation_keeps_outputs_and_mirrors() -> None:
    require_kernels()
    rng = random.Random(3)
    systems = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(2)]
    prompts = [systems[i % 2] + [rng.randrange(3, 500) for _ in range(rng.randint(6, 12))] for i in range(4)]
    order = list(range(4)) * 2  # each prompt asked twice, the repeats after all firsts

    # Without speculation, in process: each request alone, as the server runs them (a third
    # round asks for logprobs).
    want = []
    with Engine(config=dataclasses.replace(CFG, cache="none")) as eng:
        for k, i in enumerate(order + list(range(4))):
            sp = _params(i)
            o = eng.generate([prompts[i]], SamplingParams(
                max_tokens=MAX_NEW, temperature=sp["temperature"], seed=sp.get("seed"), ignore_eos=True,
                logprobs=k >= len(order)))[0]
            want.append((o.token_ids, _bits(o.logprobs) if k >= len(order) else []))

    spec = dataclasses.replace(CFG, speculative="ngram-tree", speculative_row_cost=0.0, speculative_pricing="row-cost")
    with running_server(engine=spec, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        picks = _record_picks(handle)
        stored = _count_stored(handle)
        _wait_mirrors(handle, stored)
        outs = []
        for i in order:
            outs.append(_gen(url, prompts[i], _params(i)))
            _wait_mirrors(handle, stored)
        assert [(o["output_ids"], []) for o in outs] == want[: len(order)]
        for k, (p, o) in enumerate(zip(picks, outs, strict=True)):
            assert p["synced"], (k, p)
            assert p["served"][p["core"]] == o["meta_info"]["cached_tokens"], (k, p, o["meta_info"])
        for k in range(4, 8):  # a repeat: on the core that holds the first answer, drafted from it
            first, again = picks[k - 4], picks[k]
            assert again["core"] == first["core"], (k, first, again)
            meta = outs[k]["meta_info"]
            assert meta["cached_tokens"] == len(prompts[order[k]]) - 1, meta
        accepted = [o["meta_info"].get("spec_accepted_tokens", 0) for o in outs]
        assert sum(accepted[4:]) >= 20, accepted
        assert {p["core"] for p in picks} == {0, 1}
        for w in handle.client.dispatcher.workers:
            st = w.mirror.status
            assert (st.resyncs, st.gaps, st.mismatches) == (0, 0, 0), st
        # Logprobs too are those of decoding without speculation, bit for bit.
        lp = [_gen(url, prompts[i], _params(i), logprobs=True) for i in range(4)]
        got = [(o["output_ids"], _bits([v for v, _, _ in o["meta_info"]["output_token_logprobs"]])) for o in lp]
        assert got == want[len(order) :]
        accepted += [o["meta_info"].get("spec_accepted_tokens", 0) for o in lp]
        assert sum(accepted[8:]) > 0, accepted
        stats = handle.stats()
        assert stats["dp_size"] == 2 and stats["speculative_accepted_tokens"] == sum(accepted)
        handle.check_integrity()
