"""Tensor-parallel shards run on threads of the test process, for fast checks of the
sharding rules without starting processes.

:class:`ThreadGroup` implements the two collectives a shard model calls (``all_reduce``,
``gather_columns``) with a barrier and shared buffers: every rank sums the partial results
in rank order, so all ranks get identical bits, as with gloo. The process-based group
(``radixserve.parallel``) is tested end to end in ``test_tp_engine.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput
from radixserve.parallel.shard_model import build_shard_model
from radixserve.parallel.sharding import plan_shards


class ThreadGroup:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group = group
        self.rank = rank
        self.calls = {"all_reduce": 0, "gather": 0}

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        total = g.slots[0].clone()
        for s in g.slots[1:]:
            total += s
        g.barrier.wait()
        self.calls["all_reduce"] += 1
        return t.copy_(total)

    def gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        g = self.group
        g.slots[self.rank] = t
        g.barrier.wait()
        out = torch.cat(list(g.slots), dim=1)[:, :width].contiguous() if self.rank == 0 else t
        g.barrier.wait()
        self.calls["gather"] += 1
        return out


class ThreadShards:
    """N shard models (with their KV pools) of one model, run together on N threads."""

    def __init__(self, config: ModelConfig, state_dict: Mapping[str, torch.Tensor], size: int,
                 capacity: int = 512, dtype: torch.dtype = torch.float32, backend: str = "torch",
                 lm_head: str = "vocab"):
        self.group = ThreadGroup(size)
        self.plan = plan_shards(config, size)
        self.comms = [self.group.comm(r) for r in range(size)]
        self.models = [build_shard_model(config, state_dict, s, c, dtype=dtype, lm_head=lm_head)
                       for s, c in zip(self.plan, self.comms)]
        self.pools = [KVPool(config.num_layers, capacity, s.num_kv_heads, config.head_dim, dtype)
                      for s in self.plan]
        self.backends = [make_attention_backend(backend) for _ in range(size)]
        self.skip_logits_on_workers = lm_head == "rank0"

    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        outs: list[ForwardOutput | BaseException | None] = [None] * len(self.models)

        def run(r: int) -> None:
            batch = fb
            if r and self.skip_logits_on_workers:
                n = fb.num_seqs
                batch = ForwardBatch(fb.input_ids, fb.positions, fb.out_slots, fb.seq_slots,
                                     fb.prefix_lens, fb.extend_lens, [False] * n, [False] * n)
            try:
                outs[r] = self.models[r].forward(batch, self.pools[r], self.backends[r])
            except BaseException as e:  # noqa: BLE001 - surfaced below
                outs[r] = e
                self.group.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(1, len(self.models))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        for o in outs:
            if isinstance(o, BaseException):
                raise o
        return outs[0]  # type: ignore[return-value]
