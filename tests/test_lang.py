"""radixserve.lang on the tiny random model (greedy, so deterministic).

References are computed by calling a *separate* engine directly (prompt text in, greedy
tokens / prompt logprobs out), so each test checks the language against the runtime's own
answer rather than against itself.
"""

from __future__ import annotations

import socket

import pytest

from radixserve import SamplingParams
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
from radixserve.lang.backend import common_prefix_len

PREFIX = "The quick brown fox jumps over the lazy dog. A radix tree stores shared prefixes once. "


@pytest.fixture(scope="module")
def backend(tiny_loaded):
    b = EngineBackend(Engine(tiny_loaded, dtype="float32", kv_cache_tokens=4096))
    yield b
    b.close()


@pytest.fixture(scope="module")
def ref(tiny_loaded) -> Engine:
    return Engine(tiny_loaded, dtype="float32", kv_cache_tokens=4096, cache="none")


def ref_gen(ref: Engine, prompt: str, max_tokens: int, stop=None) -> str:
    return ref.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop))[0].text


def ref_scores(ref: Engine, prefix: str, choices: list[str]) -> list[float]:
    """Mean logprob of each choice's tokens, straight from the engine's prompt logprobs."""
    tok = ref.tokenizer
    p_ids = tok.encode(prefix)
    out = []
    for c in choices:
        ids = tok.encode(prefix + c)
        start = common_prefix_len(p_ids, ids)
        o = ref.generate([ids], SamplingParams(max_tokens=0, temperature=0, logprob_start_len=start))[0]
        lps = [lp for _, lp in o.prompt_logprobs]
        assert len(lps) == len(ids) - start
        out.append(sum(lps) / len(lps))
    return out


@function
def qa(s, question):
    s += PREFIX + "Q: " + question + "\nA:"
    s += gen("answer", max_tokens=6)
    s += "\nSure?" + select("sure", choices=[" yes", " no", " maybe so"])


def test_captured_variables_equal_direct_generation(backend, ref):
    st = qa.run(question="What is the capital of France?", temperature=0, backend=backend)
    prompt = PREFIX + "Q: What is the capital of France?\nA:"
    assert st["answer"] == ref_gen(ref, prompt, 6)
    assert st.text().startswith(prompt + st["answer"] + "\nSure?")
    assert st.text().endswith(st["sure"])
    meta = st.get_meta_info("answer")
    assert meta.prompt_tokens == len(ref.tokenizer.encode(prompt))
    assert meta.finish_reason in ("length", "stop")


def test_select_equals_direct_scoring(backend, ref):
    choices = [" Paris", " London", " a radix tree", " x"]
    prefix = PREFIX + "The answer is"

    @function
    def pick(s):
        s += prefix
        s += select("c", choices=choices)

    st = pick.run(backend=backend)
    want = ref_scores(ref, prefix, choices)
    got = st.get_meta_info("c").normalized_logprobs
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert st["c"] == choices[max(range(len(choices)), key=lambda i: want[i])]
    # "sum" picks by total logprob instead.
    @function
    def pick_sum(s):
        s += prefix + select("c", choices=choices, choices_method="sum")

    st2 = pick_sum.run(backend=backend)
    sums = st2.get_meta_info("c").sum_logprobs
    assert st2["c"] == choices[max(range(len(choices)), key=lambda i: sums[i])]


def test_fork_join_gather_and_concat(backend, ref):
    @function
    def branches(s):
        s += PREFIX
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Idea {i}:" + gen("idea", max_tokens=5)
        forks.join()
        s += "Done."

    st = branches.run(temperature=0, backend=backend)
    ideas = st["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3
    assert ideas == [ref_gen(ref, PREFIX + f"Idea {i}:", 5) for i in range(3)]
    assert st.text() == PREFIX + "Done."  # branches do not leak text into the parent

    @function
    def concat(s):
        s += PREFIX
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"[{i}]" + gen("x", max_tokens=3)
        forks.join("concate_and_append")

    st2 = concat.run(temperature=0, backend=backend)
    parts = [f"[{i}]" + ref_gen(ref, PREFIX + f"[{i}]", 3) for i in range(2)]
    assert st2.text() == PREFIX + "".join(parts)


def test_hint_on_branches_hit_the_shared_prefix(backend):
    backend.flush_cache()
    prefix = PREFIX * 3

    forks_holder = {}

    @function
    def prog2(s):
        s += prefix
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"\nBranch {i}:" + gen("out", max_tokens=4)
        forks_holder["f"] = forks
        forks.join()

    before = backend.stats()["finished_requests"]
    prog2.run(temperature=0, backend=backend, hint=True)
    after = backend.stats()["finished_requests"]
    assert after - before == 5  # 1 hint + 4 branches
    tok = backend.tokenizer
    p_ids = tok.encode(prefix)
    for i, f in enumerate(forks_holder["f"]):
        meta = f.get_meta_info("out")
        boundary = common_prefix_len(p_ids, tok.encode(prefix + f"\nBranch {i}:"))
        assert boundary >= len(p_ids) - 1
        assert meta.cached_tokens >= boundary, (i, meta)

    # Hint off: no prefill-only request is sent.
    backend.flush_cache()
    before = backend.stats()["finished_requests"]
    prog2.run(temperature=0, backend=backend, hint=False)
    assert backend.stats()["finished_requests"] - before == 4


def test_run_batch_equals_sequential(backend):
    qs = [{"question": q} for q in ["Hello?", "What is a radix tree?", "How are you today?", "Why?", "2+2?"]]
    seq = [qa.run(temperature=0, backend=backend, **kw) for kw in qs]
    backend.flush_cache()
    batch = qa.run_batch(qs, num_threads=4, temperature=0, backend=backend)
    assert [s.text() for s in batch] == [s.text() for s in seq]
    assert [s["sure"] for s in batch] == [s["sure"] for s in seq]


def test_roles_follow_the_chat_template(backend):
    @function
    def chat(s):
        s += system("Be brief.")
        s += user("Hi there")
        s += assistant(gen("reply", max_tokens=4))
        s += user("Bye")

    st = chat.run(temperature=0, backend=backend)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == st["reply"]
    want = backend.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    assert st.text() == want
    # The generation prompt is exactly what the template produces for the history.
    prompt = backend.tokenizer.apply_chat_template(msgs[:2], add_generation_prompt=True)
    assert st.get_meta_info("reply").prompt_tokens == len(backend.tokenizer.encode(prompt))


def test_a_model_without_a_chat_template_has_no_role_blocks(tmp_path):
    """A base model (its GGUF ships no chat template) gets no stand-in template: role blocks
    fail naming the missing template, plain text and gen still run; ``chat_template=``
    gives one."""
    from gguf_writer import write_tiny_gguf

    path = str(tmp_path / "base.gguf")
    write_tiny_gguf(path, chat_template=None)

    @function
    def chat(s):
        s += user("Hi")
        s += assistant(gen("reply", max_tokens=2))

    @function
    def plain(s):
        s += "Hi " + gen("reply", max_tokens=2)

    b = EngineBackend(Engine(path, dtype="float32", kv_cache_tokens=512))
    try:
        with pytest.raises(ValueError, match="ships no chat template"):
            chat.run(temperature=0, backend=b)
        assert plain.run(temperature=0, backend=b).text().startswith("Hi ")
    finally:
        b.close()
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    b = EngineBackend(Engine(path, dtype="float32", kv_cache_tokens=512), chat_template=template)
    try:
        st = chat.run(temperature=0, backend=b)
        assert st.text() == f"<user>Hi</user><assistant>{st['reply']}</assistant>"
    finally:
        b.close()


def test_stream_yields_the_whole_text_in_order(backend):
    st = qa.run(question="Hello?", temperature=0, backend=backend, stream=True)
    chunks = list(st.text_iter())
    assert len(chunks) > 3
    assert "".join(chunks) == st.text()
    assert st.text() == qa.run(question="Hello?", temperature=0, backend=backend).text()


def test_unknown_variable_is_a_clear_key_error(backend):
    st = qa.run(question="Hi", temperature=0, backend=backend)
    with pytest.raises(KeyError, match="nope"):
        st["nope"]


def test_select_without_choices_is_a_value_error():
    with pytest.raises(ValueError, match="choices"):
        select("x", choices=[])
    with pytest.raises(ValueError, match="choices"):
        select("x")
    with pytest.raises(ValueError, match="choices_method"):
        select("x", choices=["a"], choices_method="magic")


def test_request_errors_surface_from_run(backend):
    @function
    def too_long(s):
        s += "Hello"
        s += gen("x", max_tokens=10**7)

    with pytest.raises(ValueError, match="max_tokens"):
        too_long.run(backend=backend)

    @function
    def empty(s):
        s += gen("x", max_tokens=2)

    with pytest.raises(ValueError, match="empty"):
        empty.run(backend=backend)


def test_backend_down_names_the_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        RuntimeEndpoint(url, timeout=5)


def test_no_backend_is_a_clear_error():
    from radixserve.lang import interpreter

    saved = interpreter._default_backend
    interpreter._default_backend = None
    try:
        with pytest.raises(RuntimeError, match="set_default_backend"):
            qa.run(question="x")
    finally:
        interpreter._default_backend = saved
