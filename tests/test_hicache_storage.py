"""HiRadixCache with L3: round trips through a directory and a real Redis, sharing between
caches ("servers"), prefetch policies, and faults (storage down, damaged or foreign objects).

Every request goes through ``Driver.serve``, which checks the KV of every slot a match hands
out against the KV its prefix must have; ``check_integrity`` runs after every request.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache_helpers import DIM, HEADS, LAYERS, Driver, expected_kv, make_cache
from radixserve.cache.hicache import HiCacheConfig, HiRadixCache
from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.storage import FileStorage, ModelFingerprint, StorageClient, encode_page, page_keys
from redis_server import RedisServer, redis_server, redis_server_binary  # noqa: F401 (fixture)

P = 4  # storage page tokens in these tests


@pytest.fixture(params=["file", "redis"])
def storage_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/l3"
    srv = request.getfixturevalue("redis_server")
    import redis

    redis.Redis.from_url(srv.url).flushdb()
    return srv.url


def serve_all(d: Driver, seqs, salt=None):
    out = []
    for s in seqs:
        out.append(d.serve(s, salt))
        d.cache.check_integrity()
    return out


def seq(n, base=1000):
    return list(range(base, base + n))


def test_round_trip_through_storage_is_bit_identical(storage_url):
    """Server A computes and writes through to L3; server B (fresh L1 and L2, same storage)
    prefetches into L2 and loads into L1: the KV matches bit for bit."""
    a = make_cache(l1=64, l2=64, storage=storage_url, storage_page_tokens=P, write_policy="write_through")
    gen = torch.Generator().manual_seed(3)
    s = seq(18)
    idx = a.allocator.alloc(18)
    data = torch.randn(LAYERS, 2, 18, HEADS, DIM, generator=gen)
    a.kv_pool.kv[:, :, idx] = data
    a.insert(s, idx)
    assert a.wait_storage_idle(10)
    assert a.stats()["l3_writes"]["stored"] == 4  # 4 whole pages; the 2-token tail is not stored
    b = make_cache(l1=64, l2=64, storage=storage_url, storage_page_tokens=P)
    h = b.prefetch(s)
    assert h is not None and h.job.wait(10) and b.prefetch_ready(h)
    assert h.status == "done" and h.present == 4 and h.inserted == (0, 16)
    m = b.match_prefix(s)
    assert (m.length, m.host_length) == (0, 16)
    m = b.load_back(m)
    b.flush_loads()
    got = b.kv_pool.kv[:, :, m.indices]
    assert torch.equal(got.view(torch.uint8), data[:, :, :16].view(torch.uint8))
    rep = b.record_admission(s, m, None, h)
    assert rep["cached"] == {"L1": 0, "L2": 0, "L3": 16}
    st = b.stats()
    assert st["hit_tokens"]["L3"] == 16 and st["bytes_moved"]["L3->L2"] == 16 * b.host_pool.bytes_per_token
    assert st["age_at_hit_s"]["L3"]["count"] == 1
    b.check_integrity()
    a.close()
    b.close()


def test_warm_restart_and_partial_local_match(storage_url):
    a = make_cache(l1=32, l2=32, storage=storage_url, storage_page_tokens=P)
    da = Driver(a)
    serve_all(da, [seq(13), seq(9) + [5, 5, 5, 5, 5]])
    assert a.wait_storage_idle(10)
    a.close()
    # "Restart": a new cache on the same storage. It computes [0, 6) itself first.
    b = make_cache(l1=32, l2=32, storage=storage_url, storage_page_tokens=P)
    db = Driver(b)
    serve_all(db, [seq(6)])
    (m, rep), = serve_all(db, [seq(13)])
    # 6 local (L1), the page [4, 8) starts inside the local part: L3 adds [6, 12).
    assert rep["cached"] == {"L1": 6, "L2": 0, "L3": 6}
    assert rep["uncached"] == {"never_seen": 1}
    (m, rep), = serve_all(db, [seq(9) + [5, 5, 5, 5, 5]])
    assert rep["cached"]["L1"] == 9 and rep["cached"]["L3"] == 3  # page [8, 12) from L3
    b.close()


def test_two_servers_share_one_redis_at_once(redis_server):  # noqa: F811
    a = make_cache(l1=32, l2=32, storage=redis_server.url, storage_page_tokens=P, model="shared")
    b = make_cache(l1=32, l2=32, storage=redis_server.url, storage_page_tokens=P, model="shared")
    other = make_cache(l1=32, l2=32, storage=redis_server.url, storage_page_tokens=P, model="other")
    prefix = [7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9]
    serve_all(Driver(a), [prefix + [1]])
    assert a.wait_storage_idle(10)
    (_, rep), = serve_all(Driver(b), [prefix + [2]])
    assert rep["cached"]["L3"] == 12
    (_, rep), = serve_all(Driver(b), [prefix + [2]], salt="tenant-b")
    assert rep["cached"]["L3"] == 0  # another tenant never sees it
    (_, rep), = serve_all(Driver(other), [prefix + [3]])
    assert rep["cached"]["L3"] == 0  # nor does another model on the same Redis
    for c in (a, b, other):
        c.close()


def test_storage_events_and_page_alignment(tmp_path):
    c = make_cache(l1=32, l2=32, storage=f"file://{tmp_path}", storage_page_tokens=P)
    evs = []
    c.listener = evs.append
    d = Driver(c)
    serve_all(d, [seq(3), seq(6), seq(11)])
    c.wait_storage_idle(10)
    l3 = [ev for ev in evs if ev.tier == "L3"]
    assert sorted(len(ev.tokens) // 4 for ev in l3) == [4, 8]
    assert all(ev.length == P and ev.kind == "stored" for ev in l3)
    assert c.stats()["l3_writes"] == {"enqueued": 2, "dropped": 0, "stored": 2, "failed": 0, "pending": 0}
    c.close()


# ---------------------------------------------------------------------- prefetch policies
class GatedFile(FileStorage):
    """A directory whose reads wait for the test to open a gate (a slow store)."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.reads = 0

    def get(self, keys):
        self.reads += 1
        if self.reads > 1:
            self.gate.wait(10)
        return super().get(keys)


def gated_cache(root, policy, timeout=0.2):
    alloc = SlotAllocator(64, 1)
    kv = KVPool(LAYERS, 64, HEADS, DIM)
    fp = ModelFingerprint.for_pool("test-model", kv, P)
    backend = GatedFile(root)
    cfg = HiCacheConfig(l2_tokens=64, storage=f"file://{root}", storage_page_tokens=P,
                        prefetch_policy=policy, prefetch_timeout_s=timeout, model_name="test-model")
    client = StorageClient(backend, fp)
    return HiRadixCache(alloc, kv, HostKVPool.like(kv, 64), cfg, client), backend


def _fill(root):
    w = make_cache(l1=64, l2=64, storage=f"file://{root}", storage_page_tokens=P)
    serve_all(Driver(w), [seq(20)])
    assert w.wait_storage_idle(10)
    w.close()


def _first_batch_arrives(h):
    deadline = time.monotonic() + 10
    while len(h.job.pages) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(h.job.pages) == 4  # the prefetcher reads 4 pages per batch; the second waits


def test_prefetch_timeout_admits_with_what_arrived(tmp_path):
    _fill(tmp_path)
    c, backend = gated_cache(tmp_path, "timeout", timeout=0.2)
    h = c.prefetch(seq(20))
    _first_batch_arrives(h)
    assert not c.prefetch_ready(h)
    time.sleep(0.25)
    assert c.prefetch_ready(h) and h.status == "timed_out"
    backend.gate.set()
    m = c.load_back(c.match_prefix(seq(20)))
    c.flush_loads()
    assert m.length == 16
    assert torch.equal(c.kv_pool.kv[:, :, m.indices], expected_kv(None, seq(20), 16))
    rep = c.record_admission(seq(20), m, None, h)
    assert rep["cached"]["L3"] == 16 and rep["uncached"] == {"prefetch_timeout": 4}
    assert c.stats()["prefetch"]["timeouts"] == 1
    c.check_integrity()
    c.close()


def test_prefetch_best_effort_and_wait_complete(tmp_path):
    _fill(tmp_path)
    c, backend = gated_cache(tmp_path, "best_effort")
    h = c.prefetch(seq(20))
    _first_batch_arrives(h)
    assert c.prefetch_ready(h) and h.status == "cut" and h.inserted == (0, 16)
    backend.gate.set()
    c.close()
    c, backend = gated_cache(tmp_path, "wait_complete")
    h = c.prefetch(seq(20))
    _first_batch_arrives(h)
    time.sleep(0.1)
    assert not c.prefetch_ready(h) and c.prefetch_status(h) == "pending"
    backend.gate.set()
    assert h.job.wait(10)
    c.poll()  # completes it without being asked
    assert h.finished and c.prefetch_ready(h) and h.inserted == (0, 20)
    assert c.match_prefix(seq(20)).host_length == 20
    c.check_integrity()
    c.close()


def test_prefetch_of_a_vanished_prefix_is_discarded(tmp_path):
    _fill(tmp_path)
    c, backend = gated_cache(tmp_path, "wait_complete")
    Driver(c).serve(seq(5))  # local [0, 5): the prefetch asks for pages from 4 on
    h = c.prefetch(seq(20))
    assert h.start == 4
    c.reset()  # the local prefix the fetched pages hang from is gone
    backend.gate.set()
    assert h.job.wait(10)
    c.poll()
    assert c.stats()["prefetch"]["discarded"] == 1 and c.num_nodes == 0
    c.check_integrity()
    c.close()


# ---------------------------------------------------------------------- faults
def test_redis_killed_mid_run_requests_still_succeed():
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    with RedisServer() as srv:
        c = make_cache(l1=32, l2=24, storage=srv.url, storage_page_tokens=P,
                       storage_timeout_s=0.5, storage_retry_s=0.3)
        d = Driver(c)
        convs = [seq(8, base=b) for b in (100, 200, 300, 400)]
        serve_all(d, convs)
        c.wait_storage_idle(10)
        srv.kill()
        for i in range(3):  # every request succeeds; storage errors become misses
            serve_all(d, [x + [i] * 4 for x in convs])
            c.wait_storage_idle(10)
        st = c.stats()
        assert st["storage"]["errors"] >= 1 and "Connection" in st["storage"]["last_error"]
        assert st["storage"]["skipped_calls"] >= 1  # backing off: one failure, not one per call
        assert st["l3_writes"]["failed"] >= 1 and st["prefetch"]["skipped"] >= 1
        srv.start()  # back on the same port (empty); writes resume after the back-off
        time.sleep(0.35)
        serve_all(d, [seq(12, base=900)])
        assert c.wait_storage_idle(10)
        assert c.stats()["l3_writes"]["stored"] > st["l3_writes"]["stored"]
        c.close()


def _written_store(root):
    a = make_cache(l1=32, l2=32, storage=f"file://{root}", storage_page_tokens=P)
    serve_all(Driver(a), [seq(16)])
    assert a.wait_storage_idle(10)
    a.close()
    fs = FileStorage(root)
    keys = page_keys(torch.tensor(seq(16), dtype=torch.int32).numpy().astype("uint32").tobytes(),
                     None, ModelFingerprint("test-model", "float32", LAYERS, HEADS, DIM, P))
    assert all(fs.exists(keys))
    return fs, keys


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_damaged_objects_are_misses_never_data(tmp_path, damage):
    fs, keys = _written_store(tmp_path)
    path = fs.path_for(keys[2])
    raw = path.read_bytes()
    if damage == "corrupt":
        b = bytearray(raw)
        b[len(b) // 2] ^= 0x10
        path.write_bytes(bytes(b))
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) - 7])
    else:  # another model's page, under the right key
        other = ModelFingerprint("someone-else", "float32", LAYERS, HEADS, DIM, P)
        path.write_bytes(encode_page(keys[2], other, torch.ones(other.page_shape)))
    c = make_cache(l1=32, l2=32, storage=f"file://{tmp_path}", storage_page_tokens=P)
    (m, rep), = serve_all(Driver(c), [seq(16)])  # the Driver checks every loaded slot's KV
    assert rep["cached"] == {"L1": 0, "L2": 0, "L3": 8}  # pages 0 and 1 only
    assert c.stats()["storage"][damage] == 1
    c.close()


def test_corrupt_object_in_redis_is_a_miss(redis_server):  # noqa: F811
    import redis

    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    a = make_cache(l1=32, l2=32, storage=redis_server.url, storage_page_tokens=P)
    serve_all(Driver(a), [seq(12)])
    a.wait_storage_idle(10)
    a.close()
    names = sorted(r.keys("rxkv:*"))
    assert len(names) == 3
    for n in names:
        r.set(n, r.get(n)[:-1])  # every page truncated
    c = make_cache(l1=32, l2=32, storage=redis_server.url, storage_page_tokens=P)
    (m, rep), = serve_all(Driver(c), [seq(12)])
    assert rep["cached"]["L3"] == 0 and c.stats()["storage"]["truncated"] == 1
    c.close()


def test_write_queue_full_drops_and_counts(tmp_path):
    class Slow(FileStorage):
        def put(self, items):
            time.sleep(0.2)
            super().put(items)

    alloc = SlotAllocator(64, 1)
    kv = KVPool(LAYERS, 64, HEADS, DIM)
    cfg = HiCacheConfig(l2_tokens=64, storage=f"file://{tmp_path}", storage_page_tokens=P,
                        write_queue_pages=2, model_name="test-model")
    c = HiRadixCache(alloc, kv, HostKVPool.like(kv, 64), cfg,
                     StorageClient(Slow(tmp_path), ModelFingerprint.for_pool("test-model", kv, P)))
    serve_all(Driver(c), [seq(24)])
    st = c.stats()["l3_writes"]
    assert st["dropped"] >= 1 and st["enqueued"] + st["dropped"] == 6
    c.wait_storage_idle(10)
    c.check_integrity()
    c.close()


def test_prefetch_larger_than_l2_keeps_the_leading_part(tmp_path):
    _fill(tmp_path)  # 5 pages of 4 tokens
    c = make_cache(l1=64, l2=10, storage=f"file://{tmp_path}", storage_page_tokens=P)
    (m, rep), = serve_all(Driver(c), [seq(20)])
    assert rep["cached"]["L3"] == 10 and c.stats()["prefetch"]["tokens"] == 10
    c.close()


def test_prefetch_that_evicts_its_namespaces_last_run_stays_reachable(tmp_path):
    """Making room in L2 for fetched pages may evict the only run of the request's salted
    namespace; the namespace's root must survive for the pages to hang from it."""
    url = f"file://{tmp_path}"
    a = make_cache(l1=32, l2=32, storage=url, storage_page_tokens=P)
    serve_all(Driver(a), [[1, 2, 3, 4, 5]], salt="s")
    assert a.wait_storage_idle(10)
    a.close()
    b = make_cache(l1=32, l2=8, storage=url, storage_page_tokens=P, write_policy="write_back")
    d = Driver(b)
    serve_all(d, [[9, 9, 9, 9, 9, 9, 9, 9]], salt="s")
    b.evict(b.evictable_size)  # [9 x 8] is now the namespace's only run, in L2, which it fills
    assert b.host_size == 8 and b.total_size == 0
    (m, rep), = serve_all(d, [[1, 2, 3, 4, 5]], salt="s")
    assert rep["cached"]["L3"] == 4 and m.length == 4
    b.close()
