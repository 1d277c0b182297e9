"""The scheduler's side of a hybrid Mamba model's recurrent state: a state slot per request,
taken at admission and given back when the request leaves, and where snapshots are taken.

A request holds one slot of the state pool (``radixserve.memory.mamba``) from admission to
finish, abort, failure or retraction. At admission the slot gets the state after the matched
prefix (the tree's snapshot, copied: ``MambaRadixCache.fork_state``), or the zero state; the
model then advances it in place, step by step, so after every successful step it holds the
state after the request's ``kv_written`` tokens. A speculative step (a draft verified) does
not write it: the model stages it and :meth:`RecurrentStates.settle` keeps the state after
the positions the step kept, so a rejected draft position never reaches the slot, nor any
snapshot taken from it.

Snapshots (copies kept by the tree) are taken at two kinds of boundary:

* **where a request leaves the cached paths** (a branch point): at admission, if the tree
  holds KV further along the prompt than its deepest snapshot, the prefill is cut into a
  chunk that ends exactly there (``cut``), and after that chunk the state is snapshotted at
  that node. The tree's KV proves that another request went through that prefix, so the
  prefix is shared: the next request that shares it (a system prompt, few-shot examples, the
  same prompt again) resumes there. A prefix seen once costs no snapshot.
* **at the end of every request that finishes normally or is retracted** (its ``kv_written``
  tokens: prompt and output but the last sampled token): the next turn of a conversation
  starts with all of this one, and a retracted request resumes where it stopped.
* **optionally, every ``interval`` tokens of a prefill** (``mamba_snapshot_interval``; 0 =
  off): at each absolute position that is a multiple of ``interval`` inside the tokens a
  request prefills (before its last one), its chunk is cut there and the state snapshotted.
  A branch point needs a *second* request through a prefix; these need none, so a later
  prompt that shares only part of a long one (a long document asked about twice with
  different questions, a prompt edited near its end) resumes at most ``interval - 1`` tokens
  before where they part, at the price of snapshots that may never be hit. Multiples of
  ``interval`` as absolute positions, not counted from the matched prefix, so two prompts
  through one prefix put their snapshots at the same nodes (the second finds the first's).

The end of a prompt is not a boundary of its own: an identical prompt cannot be served there
(the last token's logits are always computed), a longer one that continues it is served by
the end-of-request snapshot, and one that branches off before its end by a branch point.
Along one path, each snapshot taken below another with no branch between supersedes it (the
tree demotes the one above, ``MambaRadixCache.snapshot``): the interval snapshots of a long
prompt go before every snapshot in use once the request's end snapshot is taken, unless a
match ends at one again. Cutting a chunk changes no bits: the per-token scan and
batch-invariant kernels give the same state and logits however a prompt is chunked.

With a cache that is not a Mamba tree (``--cache none``) requests still get their slots,
zeroed at admission, and nothing is snapshotted.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from radixserve.cache.base import CacheHandle, PrefixCache
from radixserve.cache.mamba import MambaRadixCache
from radixserve.request import Req
from radixserve.memory.mamba import MambaStatePool

__all__ = ["RecurrentStates"]


class RecurrentStates:
    """Per-request Mamba state slots and snapshot placement (a no-op without a state pool)."""

    def __init__(self, pool: MambaStatePool | None, cache: PrefixCache, interval: int = 0) -> None:
        """``interval``: snapshot every this many tokens of a prefill as well (0 = off)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"mamba_snapshot_interval must be an integer >= 0, got {interval!r}")
        self.pool = pool
        #: The tree that keeps snapshots; None without one (no reuse of Mamba state).
        self.tree = cache if pool is not None and isinstance(cache, MambaRadixCache) else None
        #: Positions that are multiples of this get a snapshot during prefill (0: none; also
        #: 0 without a tree, where a cut would only slow the prefill down).
        self.interval = interval if self.tree is not None else 0
        self.snapshot_tokens_saved = 0  # prompt tokens admissions did not recompute thanks to a snapshot
        self.interval_snapshots = 0  # snapshots taken at a multiple of the interval that were not a branch point

    def plan(self, req: Req, key: array, matched: int) -> None:
        """Where this admission's prefill pauses for a branch-point snapshot (``req.state_split``;
        0 for none): where ``key`` leaves the tree's KV, if that is past the ``matched`` tokens."""
        reach = self.tree.kv_reach(key, req.salt) if self.tree is not None else 0
        req.state_split = reach if reach > matched else 0

    def cut(self, req: Req, start: int, chunk: int) -> int:
        """``chunk`` tokens from ``start``, cut to end at the first snapshot boundary inside
        them: the planned branch point, or a multiple of the interval before the last token
        to prefill."""
        end = start + chunk
        s = req.state_split
        if start < s < end:
            end = s
        n = self.interval
        if n:
            nxt = (start // n + 1) * n
            if nxt < end and nxt < req.num_fill:
                end = nxt
        return end - start

    def admit(self, req: Req, node: CacheHandle, matched: int) -> None:
        """Take the request's state slot and give it the state after its ``matched`` prefix
        (``node``: the match's handle)."""
        if self.pool is None:
            return
        slot = self._take(node)
        if self.tree is not None:
            if self.tree.fork_state(node, slot):
                self.snapshot_tokens_saved += matched
        else:
            self.pool.zero(slot)
        req.state_slot = slot

    def after_chunk(self, req: Req) -> None:
        """A prefill chunk of ``req`` succeeded and entered the tree: snapshot the state if the
        chunk ended at the planned branch point or at a multiple of the interval (not at the
        end of the tokens to prefill: see the module docstring)."""
        if self.tree is None:
            return
        w = req.kv_written
        at_split = False
        s = req.state_split
        if s and w >= s:
            at_split = w == s
            req.state_split = 0
        n = self.interval
        at_interval = bool(n) and w % n == 0 and w < req.num_fill
        if (at_split or at_interval) and self.tree.snapshot(req.cache_key(w), req.salt, req.state_slot):
            self.interval_snapshots += at_interval and not at_split

    def settle(self, req: Req, rows: int) -> None:
        """A speculative step of ``req`` (its state staged, not written: ``MambaStatePool.stage``)
        keeps its first ``rows`` positions: the slot becomes the state after them, before the
        request can end and snapshot it."""
        if self.pool is not None:
            self.pool.settle(req.state_slot, rows)

    def release(self, req: Req, keep: array | None) -> None:
        """The request leaves: snapshot its state at the end of ``keep`` (its written tokens,
        already in the tree; None to keep nothing) and free its slot."""
        if req.state_slot < 0:
            return
        if keep is not None and len(keep) and self.tree is not None:
            self.tree.snapshot(keep, req.salt, req.state_slot)
        self.pool.free(req.state_slot)
        req.state_slot = -1
        req.state_split = 0

    def _take(self, keep: CacheHandle | None) -> int:
        """A free slot, if need be by dropping a snapshot (never ``keep``'s: the one to fork)."""
        slot = self.pool.alloc()
        if slot is None and self.tree is not None and self.tree.evict_states(1, keep):
            slot = self.pool.alloc()
        if slot is None:  # cannot happen: a slot per request that may run, beside the snapshots
            raise RuntimeError(f"no free Mamba state slot ({self.pool.capacity} slots, "
                               f"{len(self.tree.snapshot_slots()) if self.tree else 0} held by snapshots)")
        return slot

    def stats(self) -> dict[str, float]:
        if self.pool is None:
            return {}
        out = {"mamba_state_slots": float(self.pool.capacity),
               "mamba_state_bytes_per_slot": float(self.pool.bytes_per_slot),
               "mamba_snapshot_tokens_saved": float(self.snapshot_tokens_saved),
               "mamba_interval_snapshots_taken": float(self.interval_snapshots)}
        if self.tree is not None:
            out.update({k: float(v) for k, v in self.tree.stats().items() if k.startswith(("mamba_", "max_mamba"))})
        return out

    def check(self, active: Sequence[Req], waiting: Sequence[Req]) -> None:
        """Every state slot is in exactly one place: free, one active request, or one snapshot;
        active requests hold one, waiting ones none."""
        if self.pool is None:
            for r in list(active) + list(waiting):
                if r.state_slot != -1:
                    raise AssertionError(f"request {r.rid} holds state slot {r.state_slot} of a model without one")
            return
        for r in waiting:
            if r.state_slot != -1:
                raise AssertionError(f"waiting request {r.rid} holds state slot {r.state_slot}")
        held = [r.state_slot for r in active]
        if -1 in held:
            raise AssertionError("an admitted request holds no Mamba state slot")
        if self.pool.staged:
            raise AssertionError(f"state slots {sorted(self.pool.staged)} hold a staged step between steps")
        snaps = self.tree.snapshot_slots() if self.tree is not None else []
        free = self.pool.free_slot_set()
        if len(free) != self.pool.available:
            raise AssertionError("a Mamba state slot is on the free list twice")
        every = held + snaps + list(free)
        if len(set(every)) != len(every):
            raise AssertionError("a Mamba state slot is held twice (requests, snapshots, free list)")
        if len(every) != self.pool.capacity or set(every) != set(range(self.pool.capacity)):
            raise AssertionError(f"Mamba state slot leak: {len(held)} held + {len(snaps)} snapshots + "
                                 f"{len(free)} free != capacity {self.pool.capacity}")
