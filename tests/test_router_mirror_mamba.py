"""The router's mirror of a hybrid Mamba model's tree: with the tree's state events
(``state_stored`` / ``state_dropped``) and ``states`` sent beside them, the mirror predicts
exactly the prefix the tree serves (up to the deepest state snapshot, not the KV's reach),
through snapshots, their eviction, KV eviction, resets and a resync from a snapshot."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.cache.events import STATE_DROPPED, STATE_STORED, CacheEvent
from radixserve.cache.mamba import MambaRadixCache
from radixserve.kv_events import Batch, Snapshot, decode_from_worker, encode
from radixserve.model.arch.bamba import make_state_pool
from radixserve.model.testing.tiny import tiny_random_config
from radixserve.placement.mirror import WorkerMirror, pack

CFG = tiny_random_config("bamba", num_layers=3, layer_types=("mamba", "full", "mamba"))


class Mirrored:
    """A Mamba tree whose events feed a mirror, as a worker's publisher and a router do."""

    def __init__(self, max_snapshots: int, states: bool = True) -> None:
        self.pool = make_state_pool(CFG, max_snapshots + 2)
        self.cache = MambaRadixCache(self.pool, max_snapshots, on_free=lambda _: None)
        self.mirror = WorkerMirror(1)
        assert not self.mirror.apply_message(Snapshot("w", 1, 0, 1, 0.0, [], None, 0, states))
        self.misfits: list[CacheEvent] = []
        self.kinds: set[str] = set()
        self.src = self.pool.alloc()
        self.pool.zero(self.src)
        self._slot = 0

        def listen(ev: CacheEvent) -> None:
            self.kinds.add(ev.kind)
            if not self.mirror.apply_event(ev):
                self.misfits.append(ev)

        self.cache.listener = listen

    def insert(self, ids: list[int]) -> None:
        self.cache.insert(ids, torch.arange(self._slot, self._slot + len(ids)))
        self._slot += len(ids)

    def agree(self, queries: list[list[int]]) -> None:
        assert not self.misfits, self.misfits[:3]
        for q in queries:
            want = self.cache.match_prefix(q).length
            assert self.mirror.match(pack(q)).get("L1", 0) == want, q
        fresh = WorkerMirror(1)
        assert not fresh.apply_message(Snapshot("w", 2, 0, 1, 0.0, self.cache.snapshot_events(), None, 0, True))
        for q in queries:
            assert fresh.match(pack(q)).get("L1", 0) == self.mirror.match(pack(q)).get("L1", 0), q


def test_match_stops_at_the_deepest_snapshot() -> None:
    """KV for 20 tokens, a snapshot after 8: the mirror predicts 8 where a plain mirror says
    20; a deeper snapshot moves it; a dropped one moves it back; a KV eviction takes both."""
    m = Mirrored(max_snapshots=4)
    ids = list(range(10, 30))
    m.insert(ids)
    m.agree([ids, ids[:5]])
    assert m.mirror.match(pack(ids)).get("L1", 0) == 0
    assert m.mirror.tree().held_prefix(pack(ids)) == 20
    assert m.cache.snapshot(ids[:8], None, m.src)
    m.agree([ids, ids[:8], ids[:7], ids[:12] + [1, 2]])
    assert m.mirror.match(pack(ids))["L1"] == 8
    assert m.cache.snapshot(ids[:15], None, m.src)
    m.agree([ids, ids[:14]])
    assert m.mirror.match(pack(ids))["L1"] == 15
    assert m.cache.evict_states(1) == 1  # the one at 15: the match of ids[:14] just ended at 8
    m.agree([ids, ids[:14], ids[:9]])
    assert m.mirror.match(pack(ids))["L1"] == 8
    assert m.kinds >= {STATE_STORED, STATE_DROPPED}
    assert m.cache.evict(20) == 20
    m.agree([ids])
    assert m.mirror.tree().held_prefix(pack(ids)) == 0


def test_a_plain_mirror_over_predicts() -> None:
    """The same events without ``states``: the state events do not fit (the mirror must be
    rebuilt) and, ignoring them, the KV's reach is predicted, not what the worker serves."""
    m = Mirrored(max_snapshots=4, states=False)
    ids = list(range(40, 70))
    m.insert(ids)
    m.cache.snapshot(ids[:10], None, m.src)
    assert m.misfits and m.misfits[0].kind == STATE_STORED
    assert m.mirror.match(pack(ids))["L1"] == 30 != m.cache.match_prefix(ids).length


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_stay_exact(seed: int) -> None:
    """Random inserts of branching sequences, snapshots at random held prefixes under a
    small budget, snapshot and KV evictions, and a reset: after every operation the mirror
    (and one rebuilt from the tree's snapshot events) predicts each query as the tree matches."""
    rng = random.Random(seed)
    m = Mirrored(max_snapshots=3)
    base = [rng.randrange(1, 6) for _ in range(30)]
    seqs: list[list[int]] = []

    def new_seq() -> list[int]:
        cut = rng.randrange(0, len(base))
        return base[:cut] + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]

    for _ in range(60):
        op = rng.random()
        if op < 0.35 or not seqs:
            s = new_seq()
            m.insert(s)
            seqs.append(s)
        elif op < 0.75:
            s = rng.choice(seqs)
            m.cache.snapshot(s[: rng.randrange(1, len(s) + 1)], None, m.src)
        elif op < 0.85:
            m.cache.evict_states(rng.randrange(1, 3))
        elif op < 0.97:
            m.cache.evict(rng.randrange(1, 15))
            seqs = [s for s in seqs if m.cache.kv_reach(s) == len(s)]
        else:
            m.cache.reset()
            seqs = []
        m.cache.check_integrity()
        m.agree([new_seq() for _ in range(6)] + seqs[-4:])
    assert STATE_STORED in m.kinds and STATE_DROPPED in m.kinds


def test_states_flag_travels_and_a_change_resyncs() -> None:
    """``states`` round-trips through the wire format (absent: False, as older workers send),
    and a batch whose ``states`` differs from the mirror's is a gap (resync)."""
    msg = decode_from_worker(encode(Batch("w", 1, 1, 1, 0.0, [], None, 0, True)))
    assert msg.states is True
    assert decode_from_worker(encode(Batch("w", 1, 1, 1, 0.0, [], None))).states is False
    mirror = WorkerMirror(1)
    assert not mirror.apply_message(Snapshot("w", 1, 0, 1, 0.0, [], None, 0, True))
    assert mirror.states and mirror.tree().states
    assert mirror.apply_message(Batch("w", 1, 1, 1, 0.0, [], None, 0, False))  # needs a snapshot
    assert not mirror.synced
