"""A tensor-parallel worker (every rank but 0): ``python -m radixserve.parallel.worker``.

Reads its spec (``rendezvous.worker_spec``) as JSON on stdin, joins rank 0's store,
connects its watch socket, loads the model and keeps its shard, then runs whatever rank 0
sends: a forward pass on the ForwardBatch of each step (its output is not used here; the
collectives inside it are what matter), a consistency check, or shutdown. It has no
scheduler, no tree and no sampler.

Exit status: 0 after rank 0's shutdown message; 1 on any failure, after telling rank 0 why
(the ``err`` line of the watch socket) and logging it; 1 as well when rank 0 goes away.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import traceback
from typing import Any

import torch

from radixserve.config import EngineConfig
from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.registry import load_model
from radixserve.parallel import rendezvous as rdv
from radixserve.parallel.comm import TPComm, TPFailure
from radixserve.parallel.shard_model import build_shard_model, weights_fingerprint
from radixserve.parallel.sharding import plan_shards
from radixserve.parallel.watchdog import WorkerWatch
from radixserve.parallel.wire import (HEADER_LEN, OP_CHECK, OP_FORWARD, OP_SHUTDOWN, BatchDigest, decode_forward,
                                     encode_forward)

log = logging.getLogger("radixserve.parallel")


class Worker:
    """One rank's shard, KV pool and attention backend, driven by rank 0's step messages."""

    def __init__(self, spec: dict[str, Any]):
        self.rank = int(spec["rank"])
        self.config = config = EngineConfig(**spec["config"])
        self.size = config.tp_size
        self.device = rdv.rank_device(config.device, int(spec["local_rank"]))
        self.dtype = getattr(torch, spec["dtype"])
        threads = rdv.default_threads(config)
        if threads:
            torch.set_num_threads(threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        host, port = spec["store"]
        store = rdv.open_client_store(host, int(port), config.dist_timeout_s)
        address = store.get(rdv.WATCH_KEY).decode()
        hello = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                 "options": rdv.shared_options(config)}
        self.watch = WorkerWatch(address, hello, spec.get("leader_pid"), config.dist_timeout_s)
        try:
            self.comm = TPComm(store, self.rank, self.size, self.device, config.dist_timeout_s,
                               loopback=config.nnodes == 1)
            loaded = load_model(config.model, dtype=self.dtype)
            fingerprint = weights_fingerprint(loaded.state_dict)
            shard = plan_shards(loaded.config, self.size)[self.rank]
            self.model = build_shard_model(loaded.config, loaded.state_dict, shard, self.comm, dtype=self.dtype,
                                           device=self.device, lm_head=spec.get("lm_head", "vocab"),
                                           cpu_isa=config.cpu_isa, linear_backend=config.linear_backend)
            mc = loaded.config
            del loaded
            kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
            self.kv_pool = KVPool(mc.num_layers, config.kv_cache_tokens, shard.num_kv_heads,
                                  mc.head_dim, dtype=kv_dtype, device=self.device)
            self.attn = make_attention_backend(config.attention_backend, self.device, config.cpu_isa)
            self.attn.layer_kernels(self.dtype, self.device)  # built now, not in the first step
        except BaseException as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise
        self.digest = BatchDigest()
        self.watch.send({"t": "ready", "fingerprint": fingerprint})

    def fail(self, reason: str) -> None:
        """Tell rank 0 why this rank stops (it names the rank in its own message)."""
        self.watch.send({"t": "err", "error": reason})

    def serve(self) -> None:
        """Run rank 0's steps until it says shutdown."""
        hdr_t = torch.empty(HEADER_LEN, dtype=torch.int64)
        while True:
            self.comm.broadcast(hdr_t, idle=True)
            hdr = hdr_t.tolist()
            op, step = hdr[0], hdr[1]
            if op == OP_FORWARD:
                if step != self.digest.steps + 1:
                    raise TPFailure(f"TP rank {self.rank} got step {step} after step {self.digest.steps}")
                payload = self.comm.broadcast(torch.empty(hdr[2], dtype=torch.int64))
                fb = decode_forward(hdr, payload, self.device)
                with torch.inference_mode():
                    self.model.forward(fb, self.kv_pool, self.attn)
                self.digest.update(step, encode_forward(fb, step)[1], fb.num_seqs)
            elif op == OP_CHECK:
                self.comm.all_gather_ints([self.digest.steps, self.digest.value()])
            elif op == OP_SHUTDOWN:
                return
            else:
                raise TPFailure(f"TP rank {self.rank} got an unknown operation {op}")


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    rank = spec.get("rank", "?")
    # Ctrl-C reaches the whole process group: rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=str(spec.get("log_level", "info")).upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s")
    worker: Worker | None = None
    try:
        worker = Worker(spec)
        worker.serve()
    except BaseException as e:  # noqa: BLE001 - the process ends here either way
        msg = f"{type(e).__name__}: {e}"
        if worker is not None:
            worker.fail(msg)
        log.error("TP rank %s failed: %s\n%s", rank, msg, traceback.format_exc())
        logging.shutdown()
        os._exit(1)
    logging.shutdown()


if __name__ == "__main__":
    main()
