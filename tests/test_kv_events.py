"""The worker-side publisher over real ZMQ sockets: snapshots, batches, gaps, restarts."""

from __future__ import annotations

import random
import time

import pytest
import torch
import zmq

from radixserve.cache import RadixCache
from radixserve.kv_events import (
    Batch,
    KVEventPublisher,
    Load,
    Snapshot,
    Subscribe,
    decode_from_worker,
    encode,
    load_of,
)
from radixserve.placement.mirror import WorkerMirror, leaf_paths_of_events


class Sub:
    """A minimal synchronous subscriber (what the router's EventSubscriber does, blocking)."""

    def __init__(self, endpoint: str, page: int = 1) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.mirror = WorkerMirror(page)
        self.got: list = []

    def subscribe(self, resync: bool = False) -> None:
        self.sock.send(encode(Subscribe(resync=resync)))

    def drain(self, pub: KVEventPublisher, cache, timeout: float = 2.0, until=None) -> None:
        """Let the publisher serve (as the engine loop would) and apply what arrives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pub.serve_snapshots(cache)
            while self.sock.poll(10):
                msg = decode_from_worker(self.sock.recv())
                self.got.append(msg)
                if self.mirror.apply_message(msg, time.monotonic()):
                    self.subscribe(resync=True)
            if until is None or until():
                if until is not None or not self.sock.poll(20):
                    return
        raise TimeoutError("subscriber did not get what it waited for")

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def pub():
    p = KVEventPublisher("tcp://127.0.0.1:0", "w0", page_size=1, heartbeat_s=0.05)
    yield p
    p.close()


def random_ops(cache: RadixCache, rng: random.Random, n: int, slot: list) -> None:
    for _ in range(n):
        k = rng.random()
        if k < 0.6:
            toks = [rng.randrange(4) for _ in range(rng.randint(1, 10))]
            cache.insert(toks, torch.arange(slot[0], slot[0] + len(toks)), salt=rng.choice([None, "t"]))
            slot[0] += len(toks)
        elif k < 0.8:
            cache.match_prefix([rng.randrange(4) for _ in range(6)])
        elif k < 0.97:
            cache.evict(rng.randint(1, 6))
        else:
            cache.reset()


def test_snapshot_then_batches_keep_an_exact_mirror(pub):
    cache = RadixCache()
    cache.listener = pub.publish
    rng = random.Random(0)
    slot = [0]
    random_ops(cache, rng, 30, slot)  # before anyone subscribes
    sub = Sub(pub.endpoint)
    sub.subscribe()
    sub.drain(pub, cache, until=lambda: sub.mirror.synced)
    assert isinstance(sub.got[0], Snapshot) and sub.got[0].seq == 0
    for step in range(40):
        random_ops(cache, rng, 5, slot)
        pub.flush(Load(step, 0, 100, 200, cache.total_size))
        sub.drain(pub, cache, until=lambda: sub.mirror.status.seq == pub.seq)
        assert sub.mirror.synced
        assert sub.mirror.tree().leaf_paths() == leaf_paths_of_events(cache.snapshot_events()).get("L1", set())
    seqs = [m.seq for m in sub.got if isinstance(m, Batch)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert sub.mirror.load == Load(39, 0, 100, 200, cache.total_size)
    sub.close()


def test_one_message_per_flush_and_heartbeats(pub):
    cache = RadixCache()
    cache.listener = pub.publish
    sub = Sub(pub.endpoint)
    sub.subscribe()
    sub.drain(pub, cache, until=lambda: sub.mirror.synced)
    for i in range(5):
        cache.insert([i, i + 1, i + 2], torch.arange(3 * i, 3 * i + 3))
    assert pub.flush()
    assert not pub.flush()  # nothing new, heartbeat not due
    time.sleep(0.06)
    assert pub.flush()  # heartbeat
    sub.drain(pub, cache, until=lambda: sub.mirror.status.seq == 2)
    batches = [m for m in sub.got if isinstance(m, Batch)]
    assert [len(b.events) for b in batches] == [5, 0]
    sub.close()


def test_gap_triggers_resync(pub):
    cache = RadixCache()
    cache.listener = pub.publish
    sub = Sub(pub.endpoint)
    sub.subscribe()
    sub.drain(pub, cache, until=lambda: sub.mirror.synced)
    cache.insert([1, 2, 3], torch.arange(3))
    pub.flush()
    assert sub.sock.poll(1000)
    sub.sock.recv()  # lost on the way
    cache.insert([1, 2, 3, 4], torch.arange(4))
    pub.flush()
    sub.drain(pub, cache, until=lambda: sub.mirror.status.gaps == 1 and sub.mirror.synced)
    assert sub.mirror.status.resyncs == 1
    assert sub.mirror.match(bytes(pub_bytes([1, 2, 3, 4])), None) == {"L1": 4}
    sub.close()


def pub_bytes(ids):
    from array import array

    return array("I", ids).tobytes()


def test_restarted_worker_is_detected_and_rebuilt():
    p1 = KVEventPublisher("tcp://127.0.0.1:0", "w0", heartbeat_s=0.05)
    endpoint = p1.endpoint
    c1 = RadixCache()
    c1.listener = p1.publish
    c1.insert([9, 9, 9], torch.arange(3))
    sub = Sub(endpoint)
    sub.subscribe()
    sub.drain(p1, c1, until=lambda: sub.mirror.synced)
    epoch1 = sub.mirror.status.epoch
    p1.close()
    deadline = time.monotonic() + 5
    while True:  # the closed socket leaves its port asynchronously (ZMQ's I/O thread)
        try:
            p2 = KVEventPublisher(endpoint, "w0", heartbeat_s=0.05)  # same address, fresh state
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    c2 = RadixCache()
    c2.listener = p2.publish
    c2.insert([1, 2], torch.arange(2))
    deadline = time.monotonic() + 10
    while sub.mirror.status.epoch == epoch1:  # the keepalive the router sends every second
        sub.subscribe()
        try:  # a reconnect slower than one keepalive (a loaded machine) only means another round
            sub.drain(p2, c2, timeout=0.5, until=lambda: sub.mirror.status.epoch != epoch1)
        except TimeoutError:
            pass
        assert time.monotonic() < deadline
    assert sub.mirror.synced and sub.mirror.tree().leaf_paths() == {(None, pub_bytes([1, 2]))}
    p2.close()
    sub.close()


def test_garbage_from_a_client_is_ignored(pub):
    cache = RadixCache()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(pub.endpoint)
    s.send(b"\x00not msgpack")
    time.sleep(0.1)
    assert pub.serve_snapshots(cache) == 0 and pub.subscribers == 0
    s.close(0)


def test_salts_become_strings(pub):
    cache = RadixCache()
    cache.listener = pub.publish
    sub = Sub(pub.endpoint)
    sub.subscribe()
    sub.drain(pub, cache, until=lambda: sub.mirror.synced)
    cache.insert([1, 2], torch.arange(2), salt=("tenant", 7))
    pub.flush()
    sub.drain(pub, cache, until=lambda: sub.mirror.status.seq == 1)
    assert sub.mirror.match(pub_bytes([1, 2]), "('tenant', 7)") == {"L1": 2}
    sub.close()


@pytest.mark.parametrize("kw,field", [
    ({"endpoint": "nowhere", "worker_id": "w"}, "endpoint"),
    ({"endpoint": "tcp://127.0.0.1:0", "worker_id": ""}, "worker_id"),
    ({"endpoint": "tcp://127.0.0.1:0", "worker_id": "w", "page_size": 0}, "page_size"),
])
def test_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        KVEventPublisher(**kw)


@pytest.mark.parametrize("page", [1, 4])
def test_engine_publishes_what_its_tree_holds(tiny_loaded, page):
    """A real Engine with small KV (evictions) publishing per step, as the engine core will."""
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    eng = Engine(tiny_loaded, kv_cache_tokens=160, dtype="float32", page_size=page)
    pub = KVEventPublisher("tcp://127.0.0.1:0", "w0", page_size=page, heartbeat_s=10)
    eng.cache.listener = pub.publish
    sub = Sub(pub.endpoint, page)
    sub.subscribe()
    sub.drain(pub, eng.cache, until=lambda: sub.mirror.synced)
    rng = random.Random(1)
    base = [rng.randrange(3, 500) for _ in range(30)]
    for r in range(12):
        prompt = base[: rng.randint(5, 30)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        eng.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0))
        while eng.has_unfinished():
            eng.step()
            pub.poll(eng.cache, load_of(eng))
    sub.drain(pub, eng.cache, until=lambda: sub.mirror.status.seq == pub.seq)
    assert eng.cache.evicted_tokens > 0
    assert sub.mirror.tree().leaf_paths() == leaf_paths_of_events(eng.cache.snapshot_events())["L1"]
    assert sub.mirror.load.kv_capacity == 160
    pub.close()
    sub.close()
