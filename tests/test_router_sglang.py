"""radixserve workers behind SGLang's own router (``sglang-router`` 0.3.2, cache_aware).

Skipped unless the binary is found: ``SGLANG_ROUTER_BIN=/path/to/sglang-router`` or on PATH
(``pip install sglang-router==0.3.2`` in any venv). Every endpoint it calls on a worker
must answer (the workers' access logs are checked for 404s); the HTTP/2 preface it sends to
tell gRPC from HTTP workers is expected to be refused.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest

from router_workers import free_port, running_workers

BIN = os.environ.get("SGLANG_ROUTER_BIN") or shutil.which("sglang-router")
pytestmark = pytest.mark.skipif(not BIN, reason="sglang-router not installed (set SGLANG_ROUTER_BIN)")


def test_workers_serve_behind_sglang_router():
    with running_workers(2, kv_cache_tokens=4096, extra=["--log-level", "debug"]) as ws:
        port = free_port()
        log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)
        proc = subprocess.Popen(
            [BIN, "launch", "--worker-urls", *[w.url for w in ws], "--host", "127.0.0.1",
             "--port", str(port), "--policy", "cache_aware", "--prometheus-port", str(free_port()),
             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(base + "/readiness", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "sglang-router not ready"
                time.sleep(0.2)
            c = httpx.Client(base_url=base, timeout=60)
            prompt = "A shared system prompt for the cache aware policy. " * 4
            for i in range(4):
                r = c.post("/generate", json={"text": prompt + str(i), "sampling_params": {"max_new_tokens": 3}})
                assert r.status_code == 200, r.text
            assert c.post("/v1/completions", json={"model": "tiny-random", "prompt": prompt, "max_tokens": 3}).status_code == 200
            # sglang-router itself requires "model" (422 without it).
            chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            assert c.post("/v1/chat/completions", json=chat).status_code == 200
            with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                assert r.status_code == 200 and "[DONE]" in "".join(r.iter_text())
            assert c.post("/flush_cache").status_code == 200
            assert c.get("/get_loads").status_code == 200
            time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(10)
        asked = set()
        for w in ws:
            for line in w.log().splitlines():
                m = re.search(r'"(GET|POST) (\S+) HTTP/1\.1" (\d+)', line)
                if m:
                    asked.add(m.group(2))
                    if m.group(2) == "/health" and m.group(3) == "503":
                        continue  # polled while the engine core was still loading
                    assert m.group(3).startswith("2"), line
        assert {"/health", "/server_info", "/model_info", "/get_load", "/generate", "/flush_cache"} <= asked
