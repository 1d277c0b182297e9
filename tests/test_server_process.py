"""The engine core in its own process: served exactly like in-process, and its death (or
the API process's) never leaves a client hanging or a process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from server_utils import running_server

CFG = EngineConfig(model="tiny-random", dtype="float32", kv_cache_tokens=8192, num_threads=1)


def test_process_core_serves_like_in_process() -> None:
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    ref = Engine(config=CFG).generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    with running_server(engine=CFG) as (url, handle):
        core = handle.app.state.core
        assert core.kind == "process" and core.pid != os.getpid()
        for p, want in zip(prompts, ref):
            r = httpx.post(url + "/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}, timeout=30).json()
            assert r["output_ids"] == want.token_ids
        handle.check_integrity()
    assert not psutil.pid_exists(core.pid) or psutil.Process(core.pid).status() == psutil.STATUS_ZOMBIE


def test_killed_core_fails_streams_promptly_and_health_reports_it() -> None:
    with running_server(engine=CFG) as (url, handle):
        core = handle.app.state.core
        lines: list[str] = []
        t_end: list[float] = []

        def stream() -> None:
            body = {"model": "tiny-random", "prompt": "x", "max_tokens": 1900, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
            t_end.append(time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        while len(lines) < 5:
            time.sleep(0.01)
        t_kill = time.monotonic()
        os.kill(core.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream hung after the core died"
        assert t_end[0] - t_kill < 5
        errors = [ln for ln in lines if '"error"' in ln]
        assert errors and "not available" in errors[-1] and [x for x in lines if x][-1] == "data: [DONE]"
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 503 and "SIGKILL" in h.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "x"}, timeout=5)
        assert r.status_code == 503 and r.headers.get("retry-after")


def test_core_exits_when_the_api_process_dies() -> None:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", "tiny-random", "--port", "0",
           "--log-level", "warning", "--num-threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            m = re.search(r"at (http://\S+) ", line)
            if m:
                url = m.group(1)
                break
            assert time.monotonic() < deadline
        assert url and httpx.get(url + "/health", timeout=10).status_code == 200
        children = psutil.Process(proc.pid).children()
        assert len(children) == 1
        core = children[0]
        proc.kill()  # SIGKILL: no chance to stop the core politely
        proc.wait(10)
        core.wait(timeout=15)  # it notices its parent is gone and exits
    finally:
        if proc.poll() is None:
            proc.kill()
