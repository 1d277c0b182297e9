"""The two L3 backends against real storage (a directory, a real redis-server), the client's
failure handling, and the background writer/prefetcher."""

from __future__ import annotations

import time
from array import array

import pytest
import torch

from radixserve.storage import (
    FileStorage,
    ModelFingerprint,
    PrefetchJob,
    Prefetcher,
    StorageClient,
    WriteItem,
    Writer,
    check_storage_url,
    encode_page,
    open_storage,
    page_keys,
)
from radixserve.storage.redis_store import RedisStorage
from redis_server import RedisServer, redis_server, redis_server_binary  # noqa: F401 (fixture)

FP = ModelFingerprint("m", "float32", 2, 2, 4, 4)


def pages(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = page_keys(array("I", range(1000, 1000 + 4 * n)).tobytes(), None, FP)
    return [(k, torch.randn(FP.page_shape, generator=g)) for k in keys]


@pytest.fixture(params=["file", "redis"])
def backend(request, tmp_path):
    if request.param == "file":
        b = open_storage(f"file://{tmp_path}/l3")
        assert isinstance(b, FileStorage)
    else:
        srv = request.getfixturevalue("redis_server")
        b = open_storage(srv.url)
        assert isinstance(b, RedisStorage)
        b._client.flushdb()
    yield b
    b.close()


def test_url_validation():
    for bad in ("", "file:relative", "s3://b/k", "redis://", "file://host/x", 3):
        with pytest.raises(ValueError, match="storage"):
            check_storage_url(bad)
    assert check_storage_url("redis://127.0.0.1:6379/2")
    assert check_storage_url("file:///tmp/x")


def test_backend_bytes_round_trip(backend):
    keys = [bytes([i]) * 32 for i in range(3)]
    assert backend.exists(keys) == [False] * 3
    backend.put([(keys[0], b"abc"), (keys[2], b"x" * 100_000)])
    assert backend.exists(keys) == [True, False, True]
    assert backend.get(keys) == [b"abc", None, b"x" * 100_000]
    backend.put([(keys[0], b"new")])
    assert backend.get(keys[:1]) == [b"new"]
    assert backend.exists([]) == [] and backend.get([]) == []


def test_client_store_and_fetch_chain(backend):
    client = StorageClient(backend, FP)
    ps = pages(5)
    assert client.store(ps[:3]) == [True] * 3
    assert client.store(ps[:4]) == [True] * 4  # 3 already there: only one written
    st = client.stats()
    assert st["pages_written"] == 4 and st["pages_already_present"] == 3
    keys = [k for k, _ in ps]
    assert client.count_present(keys) == 4
    got = client.fetch(keys)
    assert len(got) == 4  # stops at the first missing page
    for (_, d), p in zip(ps, got):
        assert torch.equal(p.data, d)
    assert client.stats()["errors"] == 0


def test_file_objects_damaged_on_disk_are_misses(tmp_path):
    b = FileStorage(tmp_path / "l3")
    client = StorageClient(b, FP)
    ps = pages(3)
    client.store(ps)
    keys = [k for k, _ in ps]
    path1 = b.path_for(keys[1])
    raw = bytearray(path1.read_bytes())
    raw[-5] ^= 0xFF
    path1.write_bytes(bytes(raw))
    assert len(client.fetch(keys)) == 1 and client.counters.get("corrupt") == 1
    path1.write_bytes(bytes(raw[: len(raw) // 2]))
    assert len(client.fetch(keys)) == 1 and client.counters.get("truncated") == 1
    other = ModelFingerprint("other", "float32", 2, 2, 4, 4)
    path1.write_bytes(encode_page(keys[1], other, ps[1][1]))
    assert len(client.fetch(keys)) == 1 and client.counters.get("foreign") == 1
    path1.unlink()
    assert client.count_present(keys) == 1
    # No temporary file is ever left by a completed write.
    assert not list((tmp_path / "l3").glob("*/.tmp-*"))


def test_redis_down_is_counted_never_raised_and_backs_off():
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    with RedisServer() as srv:
        t = [0.0]
        client = StorageClient(RedisStorage(srv.url, timeout_s=0.5), FP, retry_after_s=10.0,
                               clock=lambda: t[0])
        ps = pages(2)
        assert client.store(ps) == [True, True]
        srv.kill()
        keys = [k for k, _ in ps]
        assert client.count_present(keys) == 0
        assert client.fetch(keys) == []
        assert client.store(pages(1, seed=9)) is None
        st = client.stats()
        assert st["errors"] == 1 and st["skipped_calls"] == 2 and not st["healthy"]
        assert "Connection" in st["last_error"]
        srv.start()  # same port, empty (no persistence)
        t[0] = 11.0  # the back-off has passed
        assert client.store(ps) == [True, True]
        assert client.count_present(keys) == 2
        client.close()


def test_writer_drops_when_full_and_reports_results(tmp_path):
    class Slow(FileStorage):
        def put(self, items):
            time.sleep(0.05)
            super().put(items)

    client = StorageClient(Slow(tmp_path / "l3"), FP)
    w = Writer(client, max_pending_pages=2, batch_pages=1)
    ps = pages(6)
    accepted = [w.submit(WriteItem(k, d, i)) for i, (k, d) in enumerate(ps)]
    assert not all(accepted) and w.dropped == accepted.count(False)
    assert w.wait_idle(10)
    done = sorted(w.done)
    assert [tag for tag, ok in done] == [i for i, a in enumerate(accepted) if a]
    assert all(ok for _, ok in done)
    w.close()


def test_prefetcher_reads_in_order_and_can_be_cancelled(tmp_path):
    client = StorageClient(FileStorage(tmp_path / "l3"), FP)
    ps = pages(6)
    client.store(ps)
    pf = Prefetcher(client, batch_pages=2)
    job = PrefetchJob([k for k, _ in ps] + [b"\1" * 32])
    assert pf.submit(job) and job.wait(10)
    assert job.present == 6 and len(job.pages) == 6
    assert all(torch.equal(p.data, d) for p, (_, d) in zip(job.pages, ps))
    job2 = PrefetchJob([k for k, _ in ps])
    job2.cancelled = True
    pf.submit(job2)
    assert job2.wait(10) and job2.pages == []
    pf.close()
    job3 = PrefetchJob([k for k, _ in ps])
    assert not pf.submit(job3) and job3.done.is_set()
