"""Two servers started with the same command on the same machine, one while every core is busy
and one on an idle machine, compute alike: the same dtype, the same linear path, and the same
tokens and logprobs for the same requests (greedy and seeded sampling).

Nothing at startup may decide the numerics by a timing (a measurement can land on either side
of its bar when the machine is busy); this is the check that none does, through the real CLI,
each server in its own processes, with the default settings.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

REQUESTS = [
    ("The capital of France is", {"temperature": 0}),
    ("Write a haiku about rivers.", {"temperature": 0.8, "seed": 7}),
    ("List three prime numbers:", {"temperature": 0}),
    ("Once upon a time", {"temperature": 0.8, "seed": 11}),
]


def _burn(stop) -> None:  # noqa: ANN001
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _serve() -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", "smollm2-135m", "--port", "0",
           "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"at (http://\S+) ", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("the server did not start")


def _answers(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for text, sp in REQUESTS:
        body = {"text": text, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **sp}}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        lps = j["meta_info"]["output_token_logprobs"]
        out.append(([t[1] for t in lps], [t[0] for t in lps]))
    return out


def test_a_server_started_under_load_computes_like_one_started_idle():
    from fixtures_smollm2 import require_smollm2

    require_smollm2()
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 1)]
    for b in burners:
        b.start()
    procs = []
    try:
        busy, busy_url = _serve()
        procs.append(busy)
        busy_info = httpx.get(busy_url + "/server_info", timeout=30).json()
    finally:
        stop.set()
        for b in burners:
            b.join(10)
    try:
        idle, idle_url = _serve()
        procs.append(idle)
        idle_info = httpx.get(idle_url + "/server_info", timeout=30).json()
        for key in ("dtype", "linear", "linear_weights", "activations", "attention_impl", "batch_invariant"):
            assert busy_info["stats"][key] == idle_info["stats"][key], key
        assert idle_info["stats"]["batch_invariant"] is True
        assert _answers(busy_url) == _answers(idle_url)
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
