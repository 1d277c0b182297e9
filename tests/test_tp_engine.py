"""Tensor parallelism with real rank processes (gloo on CPU): ``tp_size=2`` gives the
outputs and logprobs of ``tp_size=1`` through evictions and retractions, the ranks use the
same slots, and a rank that dies or never comes stops the engine promptly, naming the rank,
with no process left behind. (The sharding rules themselves: ``test_tp_sharding.py``; the
server over HTTP: ``test_tp_server.py``.)"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.parallel import TPFailure

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
GREEDY_LP = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True,
                           prompt_logprobs=True)  # prompt logprobs: the whole prompt is computed


def tp_engine(model: object = "tiny-random", **kw: object) -> Engine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_threads", 1)
    kw.setdefault("kv_cache_tokens", 4096)
    return Engine(model, **kw)  # type: ignore[arg-type]


def shared_prefix_prompts(seed: int, n: int, prefix_len: int = 60, tail: tuple[int, int] = (5, 40)
                          ) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(prefix_len)] for _ in range(3)]
    return [rng.choice(prefixes)[: rng.randint(1, prefix_len)]
            + [rng.randrange(3, 500) for _ in range(rng.randint(*tail))] for _ in range(n)]


def worker_pids(engine: Engine) -> list[int]:
    assert engine.core.tp is not None
    return [p.pid for p in engine.core.tp.procs.values()]


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"process {pid} is still running"
            time.sleep(0.05)


def assert_logprobs_close(a: list, b: list, atol: float = 1e-4) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = (x[1], y[1]) if isinstance(x, tuple) else (x, y)
        assert (x is None) == (y is None)
        if x is not None:
            assert abs(x - y) <= atol, (x, y)


def test_tp2_equals_tp1_through_evictions_and_retractions() -> None:
    """The cache is on and the pool small: prefixes are reused, evicted and recomputed,
    decodes retracted. Same batches on both sides, so outputs and logprobs must agree."""
    prompts = shared_prefix_prompts(1, 16)
    params = [GREEDY_LP if i % 4 == 0 else GREEDY for i in range(len(prompts))]
    kw = {"kv_cache_tokens": 400, "decode_reserve_ratio": 0.0}
    ref_engine = tp_engine(**kw)
    ref = ref_engine.generate(prompts, params)
    ref_stats = ref_engine.stats()
    assert ref_stats["evicted_tokens"] > 0 and ref_stats["retractions"] > 0
    assert ref_stats["prefix_cache_hit_tokens"] > 0
    with tp_engine(tp_size=2, **kw) as eng:
        pids = worker_pids(eng)
        outs = eng.generate(prompts, params)
        s = eng.stats()  # the same scheduling decisions as with one rank
        assert (s["evicted_tokens"], s["retractions"], s["prefix_cache_hit_tokens"]) == (
            ref_stats["evicted_tokens"], ref_stats["retractions"], ref_stats["prefix_cache_hit_tokens"])
        again = eng.generate(prompts[:4], GREEDY)  # served from the tree this time
        s = eng.stats()
        assert sum(o.cached_tokens for o in again) > 0
        check = eng.check_integrity()["tp_check"]
        assert check["steps"] == s["tp"]["steps"] == s["steps"] > 0
        assert s["tp"]["comm"]["all_reduce"]["calls"] == 2 * eng.core.loaded.config.num_layers * s["steps"]
        # The check can fail: rank 0 now claims one more step's slots than the others used.
        tp = eng.core.tp
        assert tp is not None
        tp.digest.update(tp.steps, torch.arange(8), 1)
        with pytest.raises(AssertionError, match="ranks disagree on the slots"):
            eng.check_integrity()
    assert_gone(pids)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert_logprobs_close(o.logprobs, r.logprobs)
        assert (o.prompt_logprobs is None) == (r.prompt_logprobs is None)
        if r.prompt_logprobs is not None:
            assert_logprobs_close(o.prompt_logprobs, r.prompt_logprobs)
    assert [o.token_ids for o in again] == [r.token_ids for r in ref[:4]]


def test_smollm2_tp2_greedy_equals_tp1(smollm2_loaded) -> None:
    """The real model's 9 heads over 3 KV heads split unevenly (6+3 heads, 2+1 KV heads)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is a city"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=True)
    ref = tp_engine(smollm2_loaded, num_threads=0).generate(prompts, params)
    with tp_engine(smollm2_loaded, tp_size=2, num_threads=0) as eng:
        assert eng.stats()["tp"]["heads_per_rank"] == [6, 3]
        assert eng.stats()["tp"]["kv_heads_per_rank"] == [2, 1]
        outs = eng.generate(prompts, params)
        eng.check_integrity()
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert_logprobs_close(o.logprobs, r.logprobs)
        assert_logprobs_close(o.prompt_logprobs, r.prompt_logprobs)


def test_killed_rank_stops_the_engine_within_seconds() -> None:
    eng = tp_engine(tp_size=2)
    pids = worker_pids(eng)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    eng.add_request([5, 6, 7], params)
    for _ in range(3):
        eng.step()
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TPFailure, match=r"TP rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        while True:
            eng.step()
            assert time.monotonic() - t0 < 10, "steps go on after a rank died"
    assert time.monotonic() - t0 < 5
    with pytest.raises(TPFailure, match="TP rank 1"):
        eng.core.health()
    eng.close()
    assert_gone(pids)
    assert not psutil.Process().children()


def test_hung_rank_stops_the_engine_after_dist_timeout() -> None:
    """A stopped (SIGSTOP) rank never answers: the collective times out, the group stops."""
    eng = tp_engine(tp_size=2, dist_timeout_s=3)
    pids = worker_pids(eng)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(pids[0], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(TPFailure, match=r"no answer within dist_timeout_s=3s: another rank hung"):
            while True:
                eng.step()
                assert time.monotonic() - t0 < 20, "steps go on while a rank is stopped"
        assert time.monotonic() - t0 < 10
        eng.close()
        assert_gone(pids)
    finally:
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node1(port: int, *extra: str) -> subprocess.Popen:
    """``radixserve serve --node-rank 1``: the worker node of a two-machine group."""
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", "tiny-random", "--dtype", "float32",
           "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}",
           "--num-threads", "1", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def test_two_nodes_by_dist_init_addr_equal_one_rank() -> None:
    """The multi-machine path (both "nodes" on this machine): node 1 runs only its rank and
    exits 0 when rank 0 shuts the group down."""
    port = _free_port()
    prompts = shared_prefix_prompts(2, 4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = tp_engine().generate(prompts, params)
    node1 = _node1(port, "--kv-cache-tokens", "4096")
    try:
        with tp_engine(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", dist_timeout_s=60) as eng:
            assert [o.token_ids for o in eng.generate(prompts, params)] == [r.token_ids for r in ref]
            eng.check_integrity()
        assert node1.wait(20) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_startup_errors_name_the_rank_and_the_cause() -> None:
    port = _free_port()
    cfg = {"tp_size": 2, "nnodes": 2, "dist_init_addr": f"127.0.0.1:{port}"}
    # Nobody starts node 1: rank 0 gives up after dist_timeout_s.
    t0 = time.monotonic()
    with pytest.raises(TPFailure, match=r"TP rank\(s\) 1 did not connect to rank 0 within 3s"):
        tp_engine(dist_timeout_s=3, **cfg)
    assert time.monotonic() - t0 < 15
    # Node 1 started with another pool size: refused, naming the rank and the option.
    node1 = _node1(port, "--kv-cache-tokens", "1024")
    try:
        with pytest.raises(TPFailure, match=r"TP rank 1 \(pid \d+\) was started with other options than "
                                            r"rank 0: kv_cache_tokens=1024 \(rank 0 has 4096\)"):
            tp_engine(dist_timeout_s=60, **cfg)
        assert node1.wait(20) == 1  # its rank exits when rank 0 goes away
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    # A model that cannot be split over that many ranks: refused before any process starts.
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        tp_engine(tp_size=5)
    assert not psutil.Process().children()


@pytest.mark.parametrize("kw,needle", [
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": 2, "nnodes": 2}, "nnodes > 1 needs dist_init_addr"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "tp_size (3) must be a multiple of nnodes (2)"),
    ({"node_rank": 1}, "node_rank"),
    ({"dist_init_addr": "nohost"}, "dist_init_addr must be HOST:PORT"),
    ({"dist_init_addr": "h:99999"}, "dist_init_addr must be HOST:PORT"),
    ({"tp_size": 2, "hicache_l2_tokens": 1024}, "hicache_l2_tokens is not supported with tp_size > 1"),
])
def test_parallel_options_are_validated(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        EngineConfig(model="tiny-random", **kw)
    assert needle in str(exc.value)


def test_cli_tp_flag() -> None:
    from radixserve.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--tp", "2", "--nnodes", "2", "--node-rank", "1",
                                      "--dist-init-addr", "10.0.0.1:29500"])
    cfg = config_from_args(EngineConfig, args)
    assert (cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr) == (2, 2, 1, "10.0.0.1:29500")
    assert config_from_args(EngineConfig, build_parser().parse_args(["serve", "--tp-size", "4"])).tp_size == 4
