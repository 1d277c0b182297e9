"""Streaming detokenization and stop-string handling over a real byte-level BPE."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from radixserve.engine.detokenizer import IncrementalDetokenizer, StopChecker

CORPUS = [
    "héllo 世界 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café façade 日本語 テキスト 🙂🙃",
    "STOP here. END of text ###",
]
SPECIALS = ["<eos>", "<bos>"]


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # Small vocabulary: few merges, so multi-byte characters stay split across tokens.
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return _tokenizer()


def _decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return _tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(ids: list[int], prompt_tail: list[int] | None = None,
            skip_special_tokens: bool = True) -> list[str]:
    det = IncrementalDetokenizer(_decode, prompt_tail, skip_special_tokens)
    deltas = [det.add_token(t) for t in ids]
    deltas.append(det.flush())
    assert det.text == "".join(deltas)
    return deltas


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    # Precondition of the other tests: some single token decodes to U+FFFD on its own.
    ids = tok.encode("世界 🙂").ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", CORPUS + ["🙂🙂🙂 x 世", "a", "  double  spaces  "])
def test_stream_of_real_text_has_no_replacement_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    deltas = _stream(ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_prompt_tail_is_context_not_output(tok: Tokenizer) -> None:
    prompt = tok.encode("hello").ids
    out = tok.encode(" 世界 🙂 world").ids
    full = tok.decode(prompt + out)
    deltas = _stream(out, prompt_tail=prompt)
    assert "".join(deltas) == full[len(tok.decode(prompt)):]
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=0, max_value=299), max_size=40))
def test_deltas_concatenate_to_full_decode_random_ids(ids: list[int]) -> None:
    # Random ids include lone continuation bytes and truncated characters: whatever the
    # bytes, the stream must add up to the one-shot decode.
    assert "".join(_stream(ids)) == _decode(ids)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="hé世界🙂 abc\n", max_size=30))
def test_deltas_concatenate_for_valid_text(text: str) -> None:
    ids = _tokenizer().encode(text).ids
    deltas = _stream(ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("hello").ids + [eos] + tok.encode(" world").ids
    assert "".join(_stream(ids, skip_special_tokens=True)) == "hello world"
    assert "".join(_stream(ids, skip_special_tokens=False)) == "hello<eos> world"


def test_decode_fn_without_keyword_is_supported(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(lambda ids: tok.decode(ids))
    text = "日本語 ok"
    out = "".join(det.add_token(t) for t in tok.encode(text).ids) + det.flush()
    assert out == text


def test_add_tokens_group(tok: Tokenizer) -> None:
    ids = tok.encode("héllo 世界 🙂").ids
    det = IncrementalDetokenizer(_decode)
    out = det.add_tokens(ids[:3]) + det.add_tokens(ids[3:]) + det.flush()
    assert out == "héllo 世界 🙂"
    assert det.output_ids == ids


# ---------------------------------------------------------------- stop strings


def _run_stop(deltas: list[str], stop: list[str], include: bool = False,
              stop_ids: set[int] | None = None, token_ids: list[int] | None = None
              ) -> tuple[list[str], StopChecker]:
    sc = StopChecker(stop, stop_ids or set(), include)
    shown = []
    for i, d in enumerate(deltas):
        r = sc.feed(d, token_ids[i] if token_ids else None)
        shown.append(r.text)
        if r.stopped:
            break
    else:
        shown.append(sc.flush())
    return shown, sc


def test_stop_string_spanning_deltas_is_trimmed_and_never_partially_shown() -> None:
    shown, sc = _run_stop(["Hello wo", "rld ST", "O", "P and more"], ["STOP"])
    assert "".join(shown) == "Hello world "
    assert sc.stopped
    # No prefix of the final output ever contained part of "STOP".
    acc = ""
    for s in shown:
        acc += s
        assert "S" not in acc


def test_include_stop_str_in_output() -> None:
    shown, sc = _run_stop(["abc ##", "# def"], ["###"], include=True)
    assert "".join(shown) == "abc ###"
    assert sc.stopped


def test_false_alarm_prefix_is_released() -> None:
    shown, sc = _run_stop(["a ST", "ART b"], ["STOP"])
    assert not sc.stopped
    assert shown[0] == "a "  # "ST" held back
    assert "".join(shown) == "a START b"


def test_held_tail_released_at_end_of_stream() -> None:
    shown, sc = _run_stop(["x ST"], ["STOP"])
    assert shown == ["x ", "ST"]
    assert not sc.stopped


def test_earliest_stop_wins() -> None:
    shown, sc = _run_stop(["one two three"], ["three", "two"])
    assert "".join(shown) == "one "
    assert sc.text == "one "


def test_stop_token_id() -> None:
    sc = StopChecker([], {7}, False)
    assert sc.feed("abc", 3) == ("abc", False, None)
    r = sc.feed("<end>", 7)
    assert r.stopped and r.reason == 7 and r.text == ""
    sc2 = StopChecker([], {7}, True)
    sc2.feed("abc", 3)
    assert sc2.feed("<end>", 7).text == "<end>"


def test_stop_string_reason_and_no_output_after_stop() -> None:
    sc = StopChecker(["\n\n"], set(), False)
    assert sc.feed("a\n", 1) == ("a", False, None)
    r = sc.feed("\nb", 2)
    assert r == ("", True, "\n\n")
    assert sc.feed("more", 3).text == ""
    assert sc.flush() == ""


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abST OP", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
    include=st.booleans(),
)
def test_stop_matches_reference_for_any_split(text: str, cuts: list[int],
                                              include: bool) -> None:
    stops = ["STOP", "OP a", "bb"]
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    shown, sc = _run_stop(deltas, stops, include)
    # Reference: earliest (then shortest) match in the whole text.
    hits = [(text.find(s), len(s)) for s in stops if s in text]
    if hits:
        pos, n = min(hits)
        expected = text[: pos + n] if include else text[:pos]
        assert sc.stopped
    else:
        expected = text
        assert not sc.stopped
    assert "".join(shown) == expected
