"""The protocol's rules (protocol/rules.py) against plain restatements of them, and the typed
model info on both of its seams: the engine core's ModelInfo over MessagePack, and the
server's /get_model_info body read back by a router or frontend."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.engine.messages import ModelInfo, Ready, VisionSpec, hello_decoder
from radixserve.protocol.native import GenerateRequest, ImageInputSpec, ServedModelInfo
from radixserve.protocol.openai import CompletionRequest
from radixserve.protocol.rules import (MAX_CACHE_SALT_CHARS, MAX_N, ProtocolError, RequestLimits, check_cache_salt,
                                       check_n)

LIMITS = RequestLimits(max_prompt_chars=50, max_prompts_per_request=4, max_choices_per_request=8,
                       max_stop_strings=3, max_stop_string_chars=5, max_stop_token_ids=2)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@given(st.text(max_size=MAX_CACHE_SALT_CHARS + 4))
def test_cache_salt_is_accepted_exactly_when_short_nonempty_and_encodable(salt: str) -> None:
    ok = 0 < len(salt) <= MAX_CACHE_SALT_CHARS and _encodable(salt)
    try:
        assert check_cache_salt(salt) == salt and ok
    except ProtocolError as e:
        assert not ok and e.param == "cache_salt"


@given(st.one_of(st.none(), st.booleans(), st.integers(-3, MAX_N + 3), st.floats(0, 4), st.text(max_size=2)))
def test_n_is_an_integer_in_range(n: object) -> None:
    ok = n is None or (type(n) is int and 1 <= n <= MAX_N)
    try:
        assert check_n(n, "sampling_params.n") == (1 if n is None else n) and ok
    except ProtocolError as e:
        assert not ok and e.param == "sampling_params.n"


@given(st.integers(0, 10), st.integers(1, 10))
def test_counts_bound_prompts_and_choices(num_prompts: int, n: int) -> None:
    ok = num_prompts <= LIMITS.max_prompts_per_request and num_prompts * n <= LIMITS.max_choices_per_request
    try:
        LIMITS.counts(num_prompts, n)
        assert ok
    except ProtocolError as e:
        assert not ok and e.param in ("prompt", "n")


@given(st.one_of(st.none(), st.text(max_size=7), st.lists(st.text(max_size=7), max_size=5)),
       st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=4)))
def test_stops_bound_counts_and_lengths(stop: object, ids: object) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])  # type: ignore[call-overload]
    ok = (len(stops) <= LIMITS.max_stop_strings and all(len(s) <= LIMITS.max_stop_string_chars for s in stops)
          and all(_encodable(s) for s in stops) and len(ids or []) <= LIMITS.max_stop_token_ids)  # type: ignore
    try:
        LIMITS.stops(stop, ids)
        assert ok
    except ProtocolError as e:
        assert not ok and e.param in ("stop", "stop_token_ids")


def test_bodies_apply_the_rules_when_parsed() -> None:
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        CompletionRequest.model_validate({"prompt": "x", "cache_salt": ""})
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        GenerateRequest.model_validate({"text": "x", "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)})
    body = GenerateRequest.model_validate({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": MAX_N + 1}]})
    with pytest.raises(ProtocolError, match=rf"sampling_params.n must be an integer in \[1, {MAX_N}\]"):
        body.items(LIMITS)
    items = GenerateRequest.model_validate({"text": ["a", "b"], "sampling_params": {"n": 2}}).items(LIMITS)
    assert [(i.index, i.prompt, i.n) for i in items] == [(0, "a", 2), (1, "b", 2)]


def test_model_info_crosses_the_wire_unchanged() -> None:
    info = ModelInfo(model="m", arch="llama", vocab_size=49152, max_context_len=8192, eos_ids=[0, 2],
                     kv_capacity_tokens=65536, max_running_requests=64, page_size=16, dtype="bfloat16",
                     kv_cache_dtype="int8", tp_size=2,
                     vision=VisionSpec(image_token_id=7, tokens_per_image=4, processor={"size": [2, 2]}))
    got = hello_decoder().decode(msgspec.msgpack.encode(Ready(info)))
    assert isinstance(got, Ready) and got.info == info


def test_served_model_info_reads_back_what_the_server_writes() -> None:
    info = ServedModelInfo(model_path="p", tokenizer_path="p", served_model_name="s", model_type="gemma3",
                           max_context_len=32, vocab_size=100, chat_template="{{x}}", chat_template_builtin=True,
                           has_image_understanding=True, architectures=["X"],
                           vision=ImageInputSpec(image_token_id=5, image_token="<image>", tokens_per_image=3,
                                                 processor={"mean": [0.5, 0.5, 0.5]}))
    body = msgspec.json.encode(info.as_json())
    assert ServedModelInfo.parse(body) == info
    # Another server (SGLang) leaves fields out and adds its own: read what is there.
    other = ServedModelInfo.parse(b'{"model_path": "q", "is_generation": true, "some_new_field": 1}')
    assert other.model_path == "q" and other.vision is None and other.tokenizer_path is None
