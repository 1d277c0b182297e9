"""Tokenizer: ids identical to transformers' tokenizer of the same GGUF, chat template identical
to ``apply_chat_template``, clear validation errors.

The tiny byte-level tokenizer tests run without transformers or the real model.
"""

from __future__ import annotations

import pytest

from fixtures_smollm2 import hf_gguf_tokenizer, smollm2  # noqa: F401  (fixture)
from radixserve.model.testing.tiny_tokenizer import byte_level_spec, tiny_tokenizer
from radixserve.chat_template import CHATML_TEMPLATE
from radixserve.model.tokenization.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "12345",
    "Order 66: pay $1,234.50 by 2024-03-01, or 3.14159e10 units",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "Grüße aus Köln — naïve café, 東京タワー, привет, مرحبا",
    "emoji 😀🚀👍🏽 and 👨‍👩‍👧 families",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines\r\n and   runs     of      spaces",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "inline <|endoftext|> special and <|im_end|>",
    "I'm sure they'll say it's DON'T",
    "",
]

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


# ---- the real SmolLM2 tokenizer vs transformers -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_matches_transformers(smollm2, text) -> None:  # noqa: F811
    ref = hf_gguf_tokenizer()
    ours = smollm2.tokenizer.encode(text)
    assert ours == ref.encode(text, add_special_tokens=False)
    # decode round-trips (skip_special_tokens=False keeps <|im_start|> etc.)
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text
    assert smollm2.tokenizer.decode(ours) == ref.decode(ours, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_special_tokens(smollm2) -> None:  # noqa: F811
    tok = smollm2.tokenizer
    ref = hf_gguf_tokenizer()
    assert tok.vocab_size == len(ref) == 49152
    assert tok.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")] == [1]
    assert tok.eos_token_id == ref.eos_token_id == 2
    assert tok.bos_token_id == ref.bos_token_id == 1
    assert tok.stop_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert tok.id_to_token(2) == "<|im_end|>"
    # add_special_tokens=True adds no BOS: SmolLM2's GGUF says add_bos_token = false.
    assert tok.encode("hi", add_special_tokens=True) == ref.encode("hi") == tok.encode("hi")


@pytest.mark.slow
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, gen) -> None:  # noqa: F811
    ref = hf_gguf_tokenizer()
    ours = smollm2.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=gen)
    theirs = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    if gen:
        assert ours.endswith("<|im_start|>assistant\n")
    # Without a system message SmolLM2's template inserts its default one.
    user_only = [MESSAGES[1]]
    assert smollm2.tokenizer.apply_chat_template(user_only) == ref.apply_chat_template(
        user_only, tokenize=False, add_generation_prompt=True
    )
    assert "You are a helpful AI assistant named SmolLM" in smollm2.tokenizer.apply_chat_template(user_only)


# ---- the tiny tokenizer, validation --------------------------------------------------------


def test_tiny_tokenizer_basics() -> None:
    tok = tiny_tokenizer(512)
    assert tok.vocab_size == 512
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.stop_token_ids == {0, 2}
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"
    # merges are learned: common words are a single token
    assert len(tok.encode(" the")) == 1


def test_byte_level_spec_is_deterministic_and_exact_size() -> None:
    assert byte_level_spec(512) == byte_level_spec(512)
    assert len(byte_level_spec(300).tokens) == 300
    assert len(byte_level_spec(2000).tokens) == 2000
    with pytest.raises(ValueError):
        byte_level_spec(100)


def test_chatml_fallback_when_no_template() -> None:
    spec = byte_level_spec(512)
    spec.chat_template = None
    tok = Tokenizer.from_spec(spec)
    out = tok.apply_chat_template(MESSAGES)
    assert out == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == out[: -len("<|im_start|>assistant\n")]
    assert tiny_tokenizer().chat_template == CHATML_TEMPLATE


def test_template_helpers_and_sandbox() -> None:
    spec = byte_level_spec(512)
    spec.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    )
    tok = Tokenizer.from_spec(spec)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<|im_start|>[{"role": "user", "content": "é"}]<|im_end|>'
    )
    from radixserve.chat_template import ChatTemplateError

    # A template's own refusal is bad input for the server (a ValueError -> 400).
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)
    spec.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError, match="unsafe|access"):
        Tokenizer.from_spec(spec).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "messages must not be empty"),
        ("hello", "messages must be a list"),
        ([{"role": "user", "content": "ok"}, "x"], r"messages\[1\] must be a dict"),
        ([{"content": "no role"}], r"messages\[0\]\.role"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
    ],
)
def test_chat_validation(messages, match) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_tokenizer().apply_chat_template(messages)


def test_encode_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="text must be a string"):
        tiny_tokenizer().encode(123)  # type: ignore[arg-type]
