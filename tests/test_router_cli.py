"""``python -m radixserve.router`` (what ``radixserve router`` will run) as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from router_workers import free_port, running_workers

_SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")])}


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixserve.router", *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_options_exit_2_naming_the_option():
    r = cli()
    assert r.returncode == 2 and "workers: at least one worker URL" in r.stderr
    r = cli("--worker", "http://127.0.0.1:1", "--worker-events", "tcp://a:1", "--worker-events", "tcp://b:2")
    assert r.returncode == 2 and "worker_events" in r.stderr
    r = cli("--worker", "http://127.0.0.1:1", "--api-key-file", "/nonexistent/keys.txt")
    assert r.returncode == 2 and "api_key_file" in r.stderr
    # (Each value's check is RouterConfig's, tested in test_router_policies.py.)


def test_serves_and_stops_on_sigterm():
    with running_workers(1, kv_cache_tokens=1024) as ws:
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "radixserve.router", "--worker", ws[0].url,
                              "--worker-events", ws[0].events, "--port", str(port),
                              "--log-level", "warning"], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        finally:
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=30)
        assert p.returncode in (0, -15), out  # uvicorn re-raises SIGTERM after a graceful stop
        assert f"listening on http://127.0.0.1:{port}" in out
