"""Streaming token ids → text, and stop-string handling on that text.

Two separate problems, two small classes:

- `IncrementalDetokenizer`: with byte-level BPE one token may hold half of a UTF-8
  character (or a lone space that a later token's decoding changes), so decoding each token
  on its own yields U+FFFD and wrong spacing. The standard fix (HF ``TextStreamer``,
  vLLM ``detokenize_incrementally``): keep two offsets into the id list, decode the window
  ``ids[prefix_offset:]`` and the already-emitted part ``ids[prefix_offset:read_offset]``,
  and emit only the suffix — and only once it no longer ends in U+FFFD (an incomplete
  character). Decoding is O(window), not O(whole output), per token.
- `StopChecker`: stop strings may span token boundaries, and a streaming client must never
  see the first half of a stop string that later completes. It holds back the longest tail
  of the text that is a prefix of some stop string and releases it once it can no longer
  match (or at the end of the stream).
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, NamedTuple

# How many prompt tokens to keep as decoding context: enough for a word-initial space or a
# multi-token character to decode as it would in the full text (vLLM uses 5).
PROMPT_CONTEXT_TOKENS: int = 5

_REPLACEMENT = "\ufffd"


def _accepts_skip_special(fn: Callable[..., str]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "skip_special_tokens"
               for p in sig.parameters.values())


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that concatenate to the full decode.
    ``decode_fn(ids) -> str`` decodes a list of ids (e.g. ``Tokenizer.decode``); if it
    accepts a ``skip_special_tokens`` keyword, this detokenizer's ``skip_special_tokens`` is
    passed through, otherwise the caller is expected to have bound it. ``prompt_ids_tail``:
    the last few prompt tokens, used only as decoding context (never emitted) so the first
    output token decodes as it does inside the full text (e.g. its leading space)."""

    def __init__(self, decode_fn: Callable[..., str], prompt_ids_tail: Iterable[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._decode_fn = decode_fn
        self._pass_skip = _accepts_skip_special(decode_fn)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids_tail or [])[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._pass_skip:
            return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)
        return self._decode_fn(ids)

    @property
    def output_ids(self) -> list[int]:
        """Generated ids seen so far (without the prompt context)."""
        return self._ids[self._num_context:]

    def add_token(self, token_id: int) -> str:
        """Append one generated id; return the newly completed text (may be "")."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append several ids at once (one decode for the whole group)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        window = self._ids[self._prefix_offset:]
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        # Nothing visible yet (e.g. a skipped special token; at the very end, nothing more to
        # say), or probably half a UTF-8 character: wait for the rest.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class StopResult(NamedTuple):
    """What one `StopChecker.feed` decided: ``text`` that may be shown now (already trimmed
    at a stop string); ``stopped``: generation must end; ``reason``: the stop string or stop
    token id that matched, None if not stopped."""

    text: str
    stopped: bool
    reason: str | int | None


class StopChecker:
    """Detects stop strings / stop token ids in a streamed text and trims the output. Feed it
    each text delta (with the token id that produced it). It returns the text safe to show:
    everything except a held-back tail that might be the start of a stop string. On a match
    the output ends right before the stop string (or right after it with
    ``include_stop_str_in_output``); the earliest match wins, and among matches starting at
    the same position the shortest. A stop *token* ends the stream too; its own text is left
    out unless ``include_stop_str_in_output`` (same rule as for stop strings). EOS handling
    (``ignore_eos``) is the engine's: pass the EOS ids in ``stop_token_ids`` if wanted."""

    def __init__(self, stop: list[str] | None = None, stop_token_ids: set[int] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in (stop or []) if s]
        self.stop_token_ids = set(stop_token_ids or ())
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.stopped = False
        self.text = ""  # everything released so far

    def feed(self, delta: str, token_id: int | None = None) -> StopResult:
        """Process the text ``delta`` produced by ``token_id``; see class doc."""
        if self.stopped:
            return StopResult("", True, None)
        buf = self._held + delta

        match = self._find_stop(buf)
        if match is not None:
            pos, s = match
            end = pos + len(s) if self.include_stop_str_in_output else pos
            return self._finish(buf[:end], s)

        if token_id is not None and token_id in self.stop_token_ids:
            out = buf if self.include_stop_str_in_output else self._held
            return self._finish(out, token_id)

        hold = self._hold_len(buf)
        out = buf[: len(buf) - hold]
        self._held = buf[len(buf) - hold:]
        self.text += out
        return StopResult(out, False, None)

    def flush(self) -> str:
        """Stream ended for another reason (length, EOS): release the held-back tail."""
        out, self._held = self._held, ""
        if self.stopped:
            return ""
        self.text += out
        return out

    def _finish(self, out: str, reason: str | int) -> StopResult:
        self._held = ""
        self.stopped = True
        self.text += out
        return StopResult(out, True, reason)

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        found = [(i, len(s), s) for s in self.stop if (i := buf.find(s)) >= 0]
        if not found:
            return None
        i, _, s = min(found)  # the earliest match; at one position, the shortest
        return i, s

    def _hold_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string.
        Any later match must start inside this suffix (a match starting earlier would have
        had to be a prefix ending at the end of ``buf`` — i.e. a longer such suffix)."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0
