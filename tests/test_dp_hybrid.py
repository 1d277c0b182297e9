"""``serve --dp 2`` with a hybrid model (the tiny Gemma 3: window 12, two sliding layers to
one full): each core has its own tree with SWA tombstones, the API process routes by its
event-fed mirrors of them.

Prompts are longer than three windows and share system prompts. Greedy outputs must equal
the in-process engine's (cache on and off), repeats must hit, and a pool small enough to
tombstone and evict must not change a token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from radixserve import Engine, SamplingParams
from radixserve.cache.events import STORED
from radixserve.config import EngineConfig, ServerConfig
from radixserve.placement.mirror import pack
from server_utils import ServerHandle, running_server

WINDOW = 12
CFG = EngineConfig(model="tiny-random-gemma3", dtype="float32", kv_cache_tokens=4096, num_threads=1)
MAX_NEW = 6


def _gen(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _in_process(cfg: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    return [o.token_ids for o in Engine(config=cfg).generate(prompts, params)]


def _on_loop(handle: ServerHandle, coro):  # noqa: ANN001, ANN202
    return asyncio.run_coroutine_threadsafe(coro, handle.loop).result(60)


def _record_picks(handle: ServerHandle) -> list[dict]:
    """Wrap the dispatcher's pick: per core, what its mirror said the core would serve of the
    prompt when it was routed (as the core matches it: all but the last token) and what it
    holds full KV for, and where the prompt went."""
    disp = handle.client.dispatcher
    orig = disp.pick
    picks: list[dict] = []

    def pick(tokens, salt=None, exclude=()):  # noqa: ANN001, ANN202
        key = pack(list(tokens)[:-1])
        served = [w.mirror.match(key, salt).get("L1", 0) for w in disp.workers]
        full = [w.mirror.tree().held_prefix(key, salt) for w in disp.workers]
        t = orig(tokens, salt, exclude)
        picks.append({"core": t.worker.index, "served": served, "full": full, "synced": disp.mirror_synced()})
        return t

    disp.pick = pick
    return picks


def _count_stored(handle: ServerHandle) -> list[list[int]]:
    """Per core, the tokens its mirror was told entered the tree (events applied so far)."""
    totals = []
    for w in handle.client.dispatcher.workers:
        total = [0]
        apply = w.mirror.apply_event

        def counted(ev, apply=apply, total=total):  # noqa: ANN001, ANN202
            if ev.kind == STORED:
                total[0] += ev.length
            return apply(ev)

        w.mirror.apply_event = counted
        totals.append(total)
    return totals


def _wait_mirrors(handle: ServerHandle, stored: list[list[int]], timeout: float = 20.0) -> None:
    """Until every core's mirror has applied all its core's events (the cores are idle): it
    was told of every token that entered the tree (held now or evicted since) and holds as
    many as the tree. The last step of a request stores its output, so nothing after it is
    missing."""
    client = handle.client

    async def state() -> list[tuple]:
        out = []
        for c, w, total in zip(client.clients, client.dispatcher.workers, stored):
            st = await c.call("stats")
            out.append((st["cached_tokens"] + st["evicted_tokens"], total[0],
                        st["cached_tokens"], w.mirror.held_tokens() if w.mirror.synced else -1))
        return out

    deadline = time.monotonic() + timeout
    while True:
        s = _on_loop(handle, state())
        if all(a == b and c == d for a, b, c, d in s):
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def _prompts(seed: int, systems: int, per_system: int, sys_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(sys_len)] for _ in range(systems)]
    out = [h + [rng.randrange(3, 500) for _ in range(rng.randint(4, 10))] for h in heads for _ in range(per_system)]
    rng.shuffle(out)
    return out


def test_registry_alias_is_the_tiny_gemma3():
    from radixserve.model.registry import KNOWN_MODELS, load_model, load_tokenizer
    from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict

    assert "tiny-random-gemma3" in KNOWN_MODELS
    m = load_model("tiny-random-gemma3", dtype=torch.float32)
    cfg = tiny_random_config("gemma3")
    assert m.config == cfg and m.name == "tiny-random-gemma3"
    want = tiny_random_state_dict(seed=0, config=cfg)
    assert m.state_dict.keys() == want.keys() and all(torch.equal(m.state_dict[k], v) for k, v in want.items())
    assert load_tokenizer("tiny-random-gemma3").encode("hi") == m.tokenizer.encode("hi")


def _run(url: str, handle: ServerHandle, prompts: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """The prompts one at a time, each routed once the mirrors have every event of the one
    before: what a mirror predicts must then be exactly what the core serves."""
    picks = _record_picks(handle)
    stored = _count_stored(handle)
    _wait_mirrors(handle, stored)
    outs = []
    for p in prompts:
        outs.append(_gen(url, p))
        _wait_mirrors(handle, stored)
    assert len(picks) == len(prompts)
    for p, o in zip(picks, outs):
        assert p["synced"]
        assert p["served"][p["core"]] == o["meta_info"]["cached_tokens"], (p, o["meta_info"])
    for w in handle.client.dispatcher.workers:
        st = w.mirror.status
        assert (st.resyncs, st.gaps, st.mismatches) == (0, 0, 0), st
        assert w.mirror.window == WINDOW
    return outs, picks


def test_dp_hybrid_routes_by_cache_and_keeps_outputs():
    sys_len = 3 * WINDOW + 6
    prompts = _prompts(0, systems=4, per_system=4, sys_len=sys_len)
    assert all(len(p) > 3 * WINDOW for p in prompts)
    want = _in_process(CFG, prompts)
    assert _in_process(dataclasses.replace(CFG, cache="none"), prompts) == want
    with running_server(engine=CFG, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        cores = handle.app.state.cores
        assert len(cores) == 2 and len({c.pid for c in cores}) == 2
        outs, picks = _run(url, handle, prompts)
        assert [o["output_ids"] for o in outs] == want
        # Each system prompt is computed once, on one core, then hit by its 3 repeats.
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert sum(c >= sys_len for c in cached) == 4 * 3, cached
        assert {p["core"] for p in picks} == {0, 1}
        stats = handle.stats()
        assert stats["dp_size"] == 2 and stats["finished_requests"] == len(prompts)
        handle.check_integrity()


def test_dp_hybrid_under_tombstones_and_eviction_stays_exact():
    """256 full-attention and 64 sliding-window tokens per core: the trees tombstone window
    KV and evict, so a core holds the full KV of prefixes it can serve only in part (or not
    at all). The mirrors know, so routing predicts exactly what each core serves."""
    cfg = dataclasses.replace(CFG, kv_cache_tokens=256, swa_kv_cache_tokens=64, max_running_requests=2)
    prompts = _prompts(1, systems=5, per_system=4, sys_len=3 * WINDOW + 4)
    want = _in_process(dataclasses.replace(CFG, cache="none"), prompts)
    assert _in_process(cfg, prompts) == want
    with running_server(engine=cfg, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        outs, picks = _run(url, handle, prompts)
        assert [o["output_ids"] for o in outs] == want
        assert {p["core"] for p in picks} == {0, 1}
        # Routing met prefixes a core holds but cannot serve whole, and hits all the same.
        cut = [p for p in picks if p["full"][p["core"]] > p["served"][p["core"]]]
        assert cut, picks
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        stats = handle.stats()
        assert stats["evicted_tokens"] > 0, stats
        handle.check_integrity()
        # All at once: routed by mirrors and in-flight prompts, batched, retracted; same tokens.
        with ThreadPoolExecutor(8) as ex:
            again = list(ex.map(lambda p: _gen(url, p), prompts))
        assert [o["output_ids"] for o in again] == want
        handle.wait_idle()
        assert handle.stats()["finished_requests"] == 2 * len(prompts)
        handle.check_integrity()
