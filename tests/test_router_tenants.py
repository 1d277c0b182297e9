"""Salted and API-key requests through the router find the worker holding their prefix.

A worker files a request's prefix under a namespace derived from its key's tenant and its
``cache_salt`` (:func:`radixserve.tenancy.cache_salt`); the router must look its mirrors up
under the same one. Each case puts a prefix on one worker *directly* (not through the
router, so nothing but the mirror can tell the router where it is), then sends the family
through the router: every request must go to that worker and hit the whole prefix, and the
router's prediction must equal what the worker reports.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from router_workers import running_router, running_workers, wait_for

PREFIX = 96
ALICE, ALICE2, BOB, ADMIN = "key-alice", "key-alice-2", "key-bob", "admin-key"


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"{ALICE}:alice\n{ALICE2}:alice\n{BOB}:bob\n")
    return str(path)


@pytest.fixture(scope="module", params=["open", "keys"])
def setup(request, keyfile):
    """``(mode, workers, router)``: open workers (salts only) or workers that take keys."""
    auth = request.param == "keys"
    extra = ["--api-key-file", keyfile, "--admin-key", ADMIN] if auth else []
    with running_workers(2, kv_cache_tokens=2048, extra=extra) as ws:
        keys = {"api_key_file": keyfile, "admin_key": ADMIN} if auth else {}
        with running_router([w.url for w in ws], [w.events for w in ws], health_interval_s=0.2,
                            **keys) as r:
            wait_for(lambda: r.call(lambda rt: all(w.mirror.synced and w.healthy for w in rt.workers)),
                     30, "mirrors in sync")
            yield request.param, ws, r


def _post(url: str, ids: list[int], key: str | None, salt: str | None) -> dict:
    body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/generate", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _routed(router) -> list[tuple[int, int]]:
    return router.call(lambda rt: [(w.routed, w.predicted_hit_tokens) for w in rt.workers])


def _place(workers, router, target: int, prefix: list[int], key: str | None, salt: str | None) -> None:
    """Compute ``prefix`` on worker ``target`` directly; wait until the router's mirror holds it."""
    held = router.call(lambda rt: rt.workers[target].mirror.held_tokens())
    _post(workers[target].url, prefix, key, salt)
    wait_for(lambda: router.call(lambda rt: rt.workers[target].mirror.held_tokens()) >= held + len(prefix),
             10, "the mirror to hold the prefix")


def _family(router, prefix: list[int], key: str | None, salt: str | None, rng: random.Random,
            n: int = 3) -> tuple[list[int], list[int], list[int]]:
    """Send ``n`` requests of the prefix's family through the router: (requests per worker,
    predicted hit tokens per worker, reported cached tokens per request)."""
    before = _routed(router)
    cached = [_post(router.url, prefix + [rng.randrange(3, 500) for _ in range(4)], key, salt)
              ["meta_info"]["cached_tokens"] for _ in range(n)]
    after = _routed(router)
    return ([a[0] - b[0] for a, b in zip(after, before)],
            [a[1] - b[1] for a, b in zip(after, before)], cached)


def test_a_salted_request_goes_where_its_prefix_is(setup):
    mode, workers, router = setup
    key = ALICE if mode == "keys" else None
    rng = random.Random(1)
    for target, salt in ((1, "conversation-7"), (0, "conversation-8")):
        prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
        _place(workers, router, target, prefix, key, salt)
        moved, predicted, cached = _family(router, prefix, key, salt, rng)
        assert moved[target] == 3 and sum(moved) == 3, (salt, moved)
        assert cached == [PREFIX] * 3, (salt, cached)
        assert predicted[target] == 3 * PREFIX, (salt, predicted)


def test_an_api_key_request_goes_where_its_tenants_prefix_is(setup):
    mode, workers, router = setup
    if mode != "keys":
        pytest.skip("needs workers that take keys")
    rng = random.Random(2)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
    _place(workers, router, 1, prefix, ALICE, None)
    # Alice's other key is the same tenant: same namespace, same worker, whole prefix.
    moved, predicted, cached = _family(router, prefix, ALICE2, None, rng)
    assert moved == [0, 3] and cached == [PREFIX] * 3 and predicted == [0, 3 * PREFIX]
    # The admin's own namespace holds nothing of it: predicted and reported 0 (and no
    # request is routed to a prefix it cannot see); nor does Bob's.
    for other in (ADMIN, BOB):
        before = _routed(router)
        got = _post(router.url, prefix + [7, 8], other, None)["meta_info"]["cached_tokens"]
        after = _routed(router)
        assert got == 0 and sum(a[1] - b[1] for a, b in zip(after, before)) == 0, other


def test_the_router_refuses_keys_the_workers_do_not_share(setup, keyfile):
    """With keys on one side only it could not file any request under the workers'
    namespace (every prediction would be 0): it says so at startup instead."""
    mode, workers, _ = setup
    from radixserve.router.fleet import Router
    from radixserve.placement.config import RouterConfig

    async def start(**keys) -> None:
        rt = Router(RouterConfig(workers=tuple(w.url for w in workers), **keys))
        try:
            await rt.start()
        finally:
            await rt.stop()

    if mode == "keys":
        with pytest.raises(RuntimeError, match="asks for an API key"):
            asyncio.run(start())
    else:
        with pytest.raises(RuntimeError, match="takes no API key"):
            asyncio.run(start(api_key_file=keyfile))
