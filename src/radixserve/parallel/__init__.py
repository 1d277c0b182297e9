"""Tensor parallelism: one model sharded over N ranks, one scheduler, one radix tree.

Shape (``--tp N``; ``EngineConfig.tp_size``; ``Engine(..., tp_size=N)``)::

    API process ──ZMQ──► engine core = rank 0: scheduler + tree + sampler + shard 0
                              │  per step: broadcast(header), broadcast(ForwardBatch)
                              ├──► rank 1: shard 1 + its KV pool   (python -m radixserve.parallel.worker)
                              └──► rank N-1 ...                    all-reduce ×2 per layer, logits gather

* **Who runs what.** Rank 0 is the engine core the API process talks to; it alone
  schedules, owns the radix tree and the slot allocator, and samples. Every rank holds a
  Megatron shard of the weights (``sharding.py``) and a KV pool of its own heads, indexed
  by the same slots. Per step rank 0 broadcasts the scheduler's decision — token ids,
  positions, slot indices, prefix/extend lengths, which rows need logits (``wire.py``) —
  and every rank runs the same forward on its shard. Because the tree never leaves rank 0,
  "the tree operations are the same on every rank" holds by construction; ``check()``
  (run by ``EngineCore.check_integrity``) shows that the slots every rank's forwards used
  are identical, with a running digest all-gathered from the ranks.
* **Starting the ranks.** On one machine rank 0 starts ranks 1..N-1 itself as child
  processes (``leader.py``). Across machines (``--nnodes M --node-rank K
  --dist-init-addr HOST:PORT``), node 0 runs ``radixserve serve`` as usual (rank 0 and its
  node's workers) and every other node runs the same command with its ``--node-rank``,
  which starts only that node's worker ranks (``node.py``): what a cluster scheduler
  launching one process per machine needs. ``HOST:PORT`` is where rank 0 listens
  (a ``TCPStore``); every rank must be started with the same model and options (checked
  at startup, naming the rank and the option that differs).
* **Collectives.** gloo on CPU, NCCL for the activations when the device is CUDA (gloo
  still carries the step messages), built as standalone process groups (``comm.py``).
* **Failures.** Each worker keeps a TCP connection to rank 0 with heartbeats
  (``watchdog.py``): a rank that dies is noticed at once (EOF, and rank 0 polls the
  processes it started), one that hangs within ``SILENCE_LIMIT_S``, one that fails says
  why. Any failure stops the whole group with a message naming the rank (``leader.py``).
  Collectives time out after ``dist_timeout_s``. Startup errors (a rank that cannot load the
  model, other options, a rank that never connects) fail the start with the rank and the
  cause.

Not supported yet: HiCache with ``tp_size > 1`` (its L2/L3 copies read rank 0's pool only),
and pipeline parallelism.
"""

from radixserve.parallel.comm import TPFailure
from radixserve.parallel.sharding import RankShard, head_split, plan_shards

__all__ = ["RankShard", "TPFailure", "head_split", "plan_shards"]
