"""CoreDispatcher: the router's policy between in-process engines publishing their events."""

from __future__ import annotations

import asyncio
import random

from radixserve.engine.engine import Engine
from radixserve.kv_events import KVEventPublisher, load_of
from radixserve.placement.dispatch import CoreDispatcher
from radixserve.placement.mirror import leaf_paths_of_events
from radixserve.sampling_params import SamplingParams


def test_dispatch_between_engine_cores(tiny_loaded):
    engines = [Engine(tiny_loaded, kv_cache_tokens=512, dtype="float32") for _ in range(2)]
    pubs = []
    for i, e in enumerate(engines):
        p = KVEventPublisher("tcp://127.0.0.1:0", f"core{i}", heartbeat_s=0.05)
        e.cache.listener = p.publish
        pubs.append(p)

    async def engine_loops(stop: asyncio.Event) -> None:
        while not stop.is_set():  # each core's loop: step when busy, publish, answer snapshots
            for e, p in zip(engines, pubs):
                if e.has_unfinished():
                    e.step()
                p.poll(e.cache, load_of(e))
            await asyncio.sleep(0.001)

    async def main() -> None:
        disp = CoreDispatcher([p.endpoint for p in pubs])
        await disp.start()
        stop = asyncio.Event()
        loops = asyncio.create_task(engine_loops(stop))
        try:
            while not disp.mirror_synced():
                await asyncio.sleep(0.01)
            rng = random.Random(0)
            families = [[rng.randrange(10, 500) for _ in range(60)] for _ in range(4)]
            where: dict = {}
            for k in range(16):
                f = k % 4
                prompt = families[f] + [rng.randrange(10, 500) for _ in range(5)]
                t = disp.pick(prompt)
                e = engines[t.worker.index]
                e.add_request(prompt, SamplingParams(max_tokens=3, temperature=0))
                while e.has_unfinished():
                    await asyncio.sleep(0.002)
                disp.finish(t)
                where.setdefault(f, set()).add(t.worker.index)
                await asyncio.sleep(0.03)  # the events of this request reach the mirror
            assert all(len(v) == 1 for v in where.values())  # each family stays on one core
            assert sorted(len([f for f in where if i in where[f]]) for i in range(2)) == [2, 2]
            for i, e in enumerate(engines):
                want = leaf_paths_of_events(e.cache.snapshot_events()).get("L1", set())
                assert disp.workers[i].mirror.tree().leaf_paths() == want
            disp.set_available(0, False)
            assert disp.pick(families[0]).worker.index == 1
            disp.set_available(0, True)
            while not disp.mirror_synced(0):
                await asyncio.sleep(0.01)
        finally:
            stop.set()
            await loops
            await disp.stop()

    asyncio.run(main())
    for p in pubs:
        p.close()
