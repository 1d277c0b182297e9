"""A machine other than rank 0's: run this node's worker ranks, and nothing else.

``radixserve serve --tp 4 --nnodes 2 --node-rank 1 --dist-init-addr HOST:PORT`` lands here:
no HTTP, no scheduler; it starts ranks ``node_rank * tp/nnodes ...`` as child processes
(each connects to rank 0 at ``HOST:PORT``), waits for them, and exits when they do — with
status 0 after rank 0's shutdown, 1 (naming the rank) when one of them fails, in which case
the others of this node are stopped too. A cluster scheduler (Slurm, a Kubernetes job,
torchrun with one process per node) starts one such process per machine.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time

import torch

from radixserve.config import EngineConfig
from radixserve.parallel import rendezvous as rdv
from radixserve.parallel.watchdog import exit_description

log = logging.getLogger("radixserve.parallel")


def run_node(config: EngineConfig, dtype: torch.dtype, log_level: str = "info") -> int:
    """Run node ``config.node_rank``'s ranks until they exit; returns the exit status."""
    if config.node_rank < 1:
        raise ValueError("run_node is for node_rank >= 1 (node 0 runs rank 0 and the server)")
    host, port = rdv.store_address(config)
    procs: dict[int, subprocess.Popen] = {}
    for rank in rdv.node_ranks(config, config.node_rank):
        spec = rdv.worker_spec(config, rank, host, port, dtype, None, log_level)
        procs[rank] = rdv.spawn_worker(spec)
    log.info("node %d: TP ranks %s started (pids %s), rank 0 at %s:%d", config.node_rank,
             list(procs), [p.pid for p in procs.values()], host, port)
    stopping: list[int] = []
    on_signal = lambda signum, _frame: stopping.append(signum)  # noqa: E731
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while procs:
            if stopping:
                log.info("node %d: stopping its TP ranks", config.node_rank)
                _stop(procs)
                return 128 + int(stopping[0])
            for rank, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[rank]
                if code != 0:
                    log.error("node %d: TP rank %d (pid %d) %s; stopping the node's other ranks",
                              config.node_rank, rank, proc.pid, exit_description(code))
                    _stop(procs)
                    return 1
            time.sleep(0.1)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
