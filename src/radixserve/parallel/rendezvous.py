"""How the ranks find each other: the store, the spec a worker starts from, per-rank choices.

Rank 0 hosts a ``torch.distributed.TCPStore`` — on loopback at a free port when all ranks
run on one machine, at ``dist_init_addr`` across machines — and publishes there the address
of its watch socket (``watchdog.py``); the process groups (``comm.py``) rendezvous through
the same store. A worker is a fresh interpreter, ``python -m radixserve.parallel.worker``,
reading a JSON :func:`worker_spec` on stdin (as the engine-core process does).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixserve.config import EngineConfig

STORE_PREFIX = "radixserve/tp/"
WATCH_KEY = "watch"

# The options every rank must agree on (the others are rank 0's business or node-local).
SHARED_FIELDS = ("model", "dtype", "attention_backend", "linear_backend", "kv_cache_tokens", "tp_size", "nnodes",
                 "dist_init_addr")


def shared_options(config: EngineConfig) -> dict[str, Any]:
    out = {n: getattr(config, n) for n in SHARED_FIELDS}
    out["device"] = torch.device(config.device).type
    return out


def mismatches(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    return [f"{k}={theirs.get(k)!r} (rank 0 has {v!r})" for k, v in mine.items() if theirs.get(k) != v]


def ranks_per_node(config: EngineConfig) -> int:
    return config.tp_size // config.nnodes


def node_ranks(config: EngineConfig, node_rank: int) -> range:
    n = ranks_per_node(config)
    return range(node_rank * n, (node_rank + 1) * n)


def rank_device(device: str, local_rank: int) -> torch.device:
    """Rank ``local_rank`` of a node takes the ``local_rank``-th accelerator after the one
    ``device`` names (``cuda`` = ``cuda:0``); CPU ranks share the CPU."""
    d = torch.device(device)
    return d if d.type == "cpu" else torch.device(d.type, (d.index or 0) + local_rank)


def default_threads(config: EngineConfig) -> int:
    """Torch threads of one rank: ``num_threads``, or the cores shared out among this
    node's ranks (0 = torch's default, for a single rank)."""
    if config.num_threads or config.tp_size == 1:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // ranks_per_node(config))


def store_address(config: EngineConfig) -> tuple[str, int]:
    """(host, port) of rank 0's store: ``dist_init_addr``, or loopback and any free port."""
    if not config.dist_init_addr:
        return "127.0.0.1", 0
    host, port = config.dist_init_addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def open_master_store(config: EngineConfig) -> tuple[dist.Store, str, int, socket.socket]:
    """Rank 0's store, listening on the store address only. Returns (store, host, port,
    listening socket — kept open for the store's lifetime)."""
    host, port = store_address(config)
    try:
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise RuntimeError(f"TP rank 0 cannot listen on {host}:{port} for the other ranks: {e}") from e
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, timedelta(seconds=config.dist_timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.fileno())
    return dist.PrefixStore(STORE_PREFIX, store), host, port, listener


def open_client_store(host: str, port: int, timeout_s: float) -> dist.Store:
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    return dist.PrefixStore(STORE_PREFIX, store)


def worker_spec(config: EngineConfig, rank: int, store_host: str, store_port: int,
                dtype: torch.dtype, leader_pid: int | None, log_level: str,
                lm_head: str = "vocab") -> dict[str, Any]:
    return {
        "config": dataclasses.asdict(config), "rank": rank,
        "local_rank": rank % ranks_per_node(config), "store": [store_host, store_port],
        "dtype": str(dtype).removeprefix("torch."), "leader_pid": leader_pid,
        "log_level": log_level, "lm_head": lm_head,
    }


def spawn_worker(spec: dict[str, Any]) -> subprocess.Popen:
    """Start one worker process (it inherits stdout/stderr: its log lines name its rank)."""
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.parallel.worker"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return proc


def log_level_name(logger_name: str = "radixserve") -> str:
    return logging.getLevelName(logging.getLogger(logger_name).getEffectiveLevel()).lower()
