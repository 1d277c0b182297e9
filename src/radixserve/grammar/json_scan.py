"""One JSON value found in model output, checked without recursion.

A tool call is JSON written by the model inside ``<tool_call>`` tags; where it ends is where
its JSON value ends (``</tool_call>`` may sit inside one of its strings), so the value has to
be read, not cut at a tag. ``json.loads`` cannot do it for output the model controls: it
recurses once per nesting level (``RecursionError`` at about a thousand), turns ``1e400`` into
``inf`` (written back as ``Infinity``, which is not JSON) and refuses integers over 4,300
digits, while a grammar allows all three. This scanner keeps an explicit stack (any depth
costs memory, never stack), reads strings and numbers with one regex each, and reports the
spans of a top-level object's members so a caller can take a member's text exactly as written.

It tells a value that is cut short (``incomplete``: more text may complete it, as in a stream)
from one that can never become valid (``invalid``). Strict JSON (RFC 8259): no ``NaN``, no
trailing commas, no raw control characters in strings.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = ["JSONScan", "Member", "scan_json", "skip_whitespace", "OK", "INCOMPLETE", "INVALID"]

OK, INCOMPLETE, INVALID = "ok", "incomplete", "invalid"

_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
# A string that the end of the text cut short (an escape may be cut too).
_STRING_CUT = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# A number that the end of the text cut short, or that more digits could still extend.
_NUMBER_CUT = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?\Z")
_LITERALS = ("true", "false", "null")

# What the scanner expects next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)


@dataclass(frozen=True)
class Member:
    """A member of the top-level object: its key (decoded) and its value's span in the text."""

    key: str
    start: int
    end: int


@dataclass(frozen=True)
class JSONScan:
    """``status``: OK, INCOMPLETE or INVALID. With OK, ``start``/``end`` span the value,
    ``is_object`` says whether it is an object and ``members`` are that object's members in
    order (empty for any other value)."""

    status: str
    start: int = 0
    end: int = 0
    is_object: bool = False
    members: tuple[Member, ...] = field(default=())

    def member(self, key: str) -> Member | None:
        """The last member named ``key`` (``json.loads`` keeps the last of duplicates too)."""
        return next((m for m in reversed(self.members) if m.key == key), None)


def skip_whitespace(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not JSON whitespace."""
    return _WS.match(text, pos).end()


def scan_json(text: str, pos: int = 0) -> JSONScan:
    """Scan the JSON value that starts at ``pos`` (after optional whitespace). Text after the
    value is not looked at. A number that ends the text could still grow, so a bare number
    at the very end is INCOMPLETE."""
    return _Scanner(text, pos).run()


# What a step of the scanner tells its loop: read on, or a value just ended at the cursor.
_MORE, _ENDED = "more", "ended"


class _Scanner:
    """The scan of one value: a cursor, the stack of open containers, the top-level
    object's members so far, and what is expected next (one step method per expectation)."""

    def __init__(self, text: str, pos: int):
        self.text, self.n = text, len(text)
        self.i = self.start = self.value_start = _WS.match(text, pos).end()
        self.stack: list[str] = []
        self.members: list[Member] = []
        self.key = ""
        self.state = _VALUE

    def run(self) -> JSONScan:
        steps = {_VALUE: self._value, _VALUE_OR_CLOSE: self._value, _KEY: self._key, _KEY_OR_CLOSE: self._key,
                 _COLON: self._colon, _COMMA_OR_CLOSE: self._comma_or_close}
        while True:
            self.i = _WS.match(self.text, self.i).end()
            if self.i >= self.n:
                return JSONScan(INCOMPLETE)
            out = steps[self.state](self.text[self.i])
            if out is _MORE:
                continue
            if out is not _ENDED:
                return out
            if not self.stack:
                return JSONScan(OK, self.start, self.i, self.text[self.start] == "{", tuple(self.members))
            if len(self.stack) == 1 and self.stack[0] == "{":
                self.members.append(Member(self.key, self.value_start, self.i))
            self.state = _COMMA_OR_CLOSE

    def _open(self, c: str, state: int) -> str:
        self.stack.append(c)
        self.i += 1
        self.state = state
        return _MORE

    def _close(self) -> str:
        self.stack.pop()
        self.i += 1
        return _ENDED

    def _value(self, c: str) -> str | JSONScan:
        if self.state == _VALUE_OR_CLOSE and c == "]":
            return self._close()
        if len(self.stack) == 1 and self.stack[0] == "{":
            self.value_start = self.i
        if c == "{":
            return self._open(c, _KEY_OR_CLOSE)
        if c == "[":
            return self._open(c, _VALUE_OR_CLOSE)
        end, status = _scalar(self.text, self.i)
        if status != OK:
            return JSONScan(status)
        self.i = end
        return _ENDED

    def _key(self, c: str) -> str | JSONScan:
        if self.state == _KEY_OR_CLOSE and c == "}":
            return self._close()
        m = _STRING.match(self.text, self.i)
        if m is None:
            return JSONScan(INCOMPLETE if c == '"' and _STRING_CUT.match(self.text, self.i) else INVALID)
        if len(self.stack) == 1:
            self.key = json.loads(m.group())
        self.i = m.end()
        self.state = _COLON
        return _MORE

    def _colon(self, c: str) -> str | JSONScan:
        if c != ":":
            return JSONScan(INVALID)
        self.i += 1
        self.state = _VALUE
        return _MORE

    def _comma_or_close(self, c: str) -> str | JSONScan:
        top = self.stack[-1]
        if c == ",":
            self.i += 1
            self.state = _KEY if top == "{" else _VALUE
            return _MORE
        if c != ("}" if top == "{" else "]"):
            return JSONScan(INVALID)
        return self._close()


def _scalar(text: str, i: int) -> tuple[int, str]:
    """``(end, status)`` of the string, number or literal at ``i``."""
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        if m is not None:
            return m.end(), OK
        return i, INCOMPLETE if _STRING_CUT.match(text, i) else INVALID
    if c == "-" or "0" <= c <= "9":
        if _NUMBER_CUT.match(text, i):  # runs to the end of the text: more may follow
            return i, INCOMPLETE
        m = _NUMBER.match(text, i)
        return (m.end(), OK) if m is not None else (i, INVALID)
    for lit in _LITERALS:
        seg = text[i:i + len(lit)]
        if seg == lit:
            return i + len(lit), OK
        if len(seg) < len(lit) and lit.startswith(seg):
            return i, INCOMPLETE
    return i, INVALID
