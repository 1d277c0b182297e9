"""``radixserve serve --tp 2`` end to end over HTTP: answers like one rank, and a rank
killed mid-stream turns into 503s within seconds, with every process of the server gone
after it stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from radixserve import Engine, SamplingParams

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", "tiny-random", "--port", "0",
           "--dtype", "float32", "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "http://" in line:
            return proc, line.split("at ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError(f"serve did not print its URL (exit status {proc.wait()})")


def _generate(url: str, ids: list[int], n: int) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_serve_tp2_answers_like_tp1_and_a_killed_rank_means_503() -> None:
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(3)]
    ref = Engine("tiny-random", dtype="float32", kv_cache_tokens=4096).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    proc, url = _serve("--tp", "2", "--kv-cache-tokens", "4096", "--num-threads", "1")
    family: list[psutil.Process] = []
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        workers = [p for p in family if "radixserve.parallel.worker" in " ".join(p.cmdline())]
        assert len(workers) == 1  # rank 1; rank 0 is the engine core
        for p, want in zip(prompts, ref):
            assert _generate(url, p, 10) == want.token_ids
        stats = httpx.get(url + "/get_server_info", timeout=10)
        assert stats.status_code == 200

        # A long stream, then rank 1 dies.
        lines: list[str] = []
        ended: list[float] = []

        def stream() -> None:
            body = {"model": "tiny-random", "prompt": "x", "max_tokens": 1900, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(r.iter_lines())
            ended.append(time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while len(lines) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lines) >= 5, "the stream did not start"
        t_kill = time.monotonic()
        os.kill(workers[0].pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream hung after a rank died"
        assert ended[0] - t_kill < 5
        assert any('"error"' in ln for ln in lines)
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 503
        assert re.search(r"TP rank 1 \(pid \d+\) was killed by signal SIGKILL", h.json()["error"]["message"])
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "x"}, timeout=5)
        assert r.status_code == 503
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    for p in family:
        while p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"pid {p.pid} ({' '.join(p.cmdline())}) outlived the server"
            time.sleep(0.05)
