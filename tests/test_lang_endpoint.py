"""radixserve.lang over HTTP: a real server on a free loopback port (tests/server_utils.py).

The same programs must give the same results through :class:`RuntimeEndpoint` as through
the in-process :class:`EngineBackend` (tiny random model, greedy).
"""

from __future__ import annotations

import pytest

from radixserve.engine.engine import Engine
from radixserve.lang import (
    EngineBackend,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)
from server_utils import start_server

PREFIX = "The quick brown fox jumps over the lazy dog. A radix tree stores shared prefixes once. "


@pytest.fixture(scope="module")
def server(tiny_loaded):
    url, handle = start_server(tiny_loaded, kv_cache_tokens=4096)
    yield url, handle
    handle.stop()


@pytest.fixture(scope="module")
def endpoint(server):
    ep = RuntimeEndpoint(server[0], timeout=60)
    yield ep
    ep.close()


@pytest.fixture(scope="module")
def local(tiny_loaded):
    b = EngineBackend(Engine(tiny_loaded, dtype="float32", kv_cache_tokens=4096))
    yield b
    b.close()


@function
def program(s, question):
    s += system("You answer questions.")
    s += user(PREFIX + question)
    s += assistant(gen("answer", max_tokens=6))
    s += "Verdict:" + select("verdict", choices=[" good", " bad", " the radix tree"])
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"\nIdea {i}:" + gen("idea", max_tokens=4, stop="\n")
    forks.join()


def test_same_program_same_result_over_http(endpoint, local):
    questions = ["What is the capital of France?", "How are you today?"]
    for q in questions:
        a = program.run(question=q, temperature=0, backend=endpoint)
        b = program.run(question=q, temperature=0, backend=local)
        assert a.text() == b.text()
        assert a.variables() == b.variables()
        sa, sb = a.get_meta_info("verdict"), b.get_meta_info("verdict")
        assert sa.normalized_logprobs == pytest.approx(sb.normalized_logprobs, rel=1e-4, abs=1e-4)


def test_run_batch_over_http_equals_sequential(endpoint):
    qs = [{"question": q} for q in ["Hello?", "Why?", "What is a radix tree?"]]
    seq = [program.run(temperature=0, backend=endpoint, **kw) for kw in qs]
    batch = program.run_batch(qs, num_threads=3, temperature=0, backend=endpoint)
    assert [s.variables() for s in batch] == [s.variables() for s in seq]


def test_fork_branches_hit_the_prefix_over_http(endpoint, server):
    assert endpoint.flush_cache()

    @function
    def prog(s):
        s += PREFIX * 3
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"\nBranch {i}:" + gen("out", max_tokens=3)
        forks.join()
        s.set_var("forks", forks)

    st = prog.run(temperature=0, backend=endpoint)
    n_prefix = endpoint.prefill(PREFIX * 3).prompt_tokens
    for f in st["forks"]:
        assert f.get_meta_info("out").cached_tokens >= n_prefix - 1


def test_streaming_over_http(endpoint, local):
    @function
    def short(s):
        s += PREFIX + "Story:"
        s += gen("story", max_tokens=8)

    st = short.run(temperature=0, backend=endpoint, stream=True)
    chunks = list(st.text_iter())
    assert len(chunks) >= 3  # the prompt, then the generation in several SSE deltas
    assert "".join(chunks) == st.text()
    assert st.text() == short.run(temperature=0, backend=local).text()
