"""OpenAI tool calls: what the model is told, the grammars that shape a call, the parser.

The call format is the one Hermes-style chat templates (Qwen2.5, Hermes, SmolLM3, ...) teach
their models, one JSON object per call between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose template knows ``tools`` gets them through the template; any other (SmolLM2's
ChatML) gets the same description as a system message. With ``tool_choice`` "required" or a
named function the whole output is a call grammar built from the tools' parameter schemas;
with "auto" the model writes freely until it writes the opening tag, and from there the
call grammar holds (a lazy grammar, as llama.cpp's tool calling has). Either way whatever the
grammar lets the model write parses: a call ends where its JSON ends, read by
:mod:`~radixserve.grammar.json_scan` (so ``</tool_call>`` inside an argument string, JSON
nested thousands deep or a number like ``1e400`` are still one call), and its arguments are
returned as the model wrote them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.grammar.json_scan import INCOMPLETE, INVALID, OK, JSONScan, scan_json, skip_whitespace
from radixserve.grammar.spec import JSON_DEFAULTS

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"

#: Most calls one forced answer may hold when the client allows parallel calls.
MAX_PARALLEL_CALLS = 4


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: "auto", "none" or "required"; ``names``: the functions allowed."""

    mode: str
    names: tuple[str, ...] = ()


def parse_tools(tools: Any) -> list[Tool]:
    """OpenAI ``tools`` -> :class:`Tool` s; ValueError naming the bad entry."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be \"function\"")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(
                c.isalnum() or c in "_-." for c in name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON Schema object")
        if params.get("type", "object") != "object":
            # A call's arguments are a JSON object: a tool taking anything else could never
            # be called (OpenAI refuses such tools as well).
            raise ValueError(f"{where}.function.parameters must be a JSON Schema of type \"object\", "
                             f"got type {params.get('type')!r}")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ValueError(f"{where}.function.description must be a string")
        out.append(Tool(name, desc, params))
    return out


def parse_tool_choice(choice: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI ``tool_choice`` (default "auto" with tools) -> :class:`ToolChoice`."""
    names = tuple(t.name for t in tools)
    if choice is None or choice == "auto":
        return ToolChoice("auto", names)
    if choice == "none":
        return ToolChoice("none")
    if choice == "required":
        return ToolChoice("required", names)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolChoice("required", (name,))
    raise ValueError('tool_choice must be "auto", "none", "required" or '
                     '{"type": "function", "function": {"name": ...}}')


def system_prompt(tools: list[Tool]) -> str:
    """The tools and the call format, for a chat template that has no ``tools`` of its own."""
    sigs = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}, ensure_ascii=False)
        for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


class CallGrammar:
    """Lark grammars (llguidance dialect, with ``%json``) of calls to the allowed tools: one
    call, or with ``parallel`` up to :data:`MAX_PARALLEL_CALLS`, each written as the parser
    reads it."""

    def __init__(self, tools: list[Tool], choice: ToolChoice, parallel: bool):
        allowed = [t for t in tools if t.name in choice.names]
        alts = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _closed(t.parameters)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
        schema: dict[str, Any] = alts[0] if len(alts) == 1 else {"anyOf": alts}
        self._body = f"body: %json {json.dumps({**schema, 'x-guidance': JSON_DEFAULTS}, ensure_ascii=False)}"
        self.max_calls = MAX_PARALLEL_CALLS if parallel else 1

    def forced(self) -> str:
        """The whole output is calls (``tool_choice`` "required" or a named function)."""
        start = "start: call" + "".join(' ("\\n" call)?' for _ in range(self.max_calls - 1))
        call = f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}"
        return "\n".join([start, call, self._body]) + "\n"

    def lazy(self) -> str:
        """Free text, in which each ``<tool_call>`` the model writes opens a call that the
        grammar then completes (``tool_choice`` "auto"). The opening tag ends a lazy lexeme
        (the shortest text up to it), so the model is unconstrained until it writes the tag;
        text after the last call allowed cannot hold the tag, so every tag the output holds
        opens a call that parses."""
        n = self.max_calls
        lines = ["start: seg0"]
        lines += [f"seg{k}: tail | call seg{k + 1}" for k in range(n)]
        lines += [
            f"seg{n}: tail",
            f"call: call_open {json.dumps(CALL_OPEN[len(_OPEN_TAG):])} body {json.dumps(CALL_CLOSE)}",
            f"call_open[lazy]: TEXT {json.dumps(_OPEN_TAG)}",
            "tail: TAIL",
            "TEXT: /(?s:.*)/",
            f"TAIL: /(?s:.*)/ & ~/(?s:.*){_OPEN_TAG}(?s:.*)/",
            self._body,
        ]
        return "\n".join(lines) + "\n"


def call_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool) -> str:
    """The forced-call grammar (:meth:`CallGrammar.forced`)."""
    return CallGrammar(tools, choice, parallel).forced()


def _closed(params: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema as the grammar uses it: an object (a schema that names no type
    describes one), and only the declared arguments (unless the schema says otherwise) —
    arguments beyond them are useless to a tool."""
    params = {**params, "type": "object"}
    if "additionalProperties" not in params:
        params["additionalProperties"] = False
    return params


def render_calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` written into its content in the call format,
    for templates that do not render ``tool_calls`` themselves."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parts = [message.get("content") or ""]
    for c in calls:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_obj = args
        parts.append(CALL_OPEN + json.dumps({"name": fn.get("name"), "arguments": args_obj},
                                            ensure_ascii=False) + CALL_CLOSE)
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join(p for p in parts if p)
    return out


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass(frozen=True)
class _Block:
    """What follows a ``<tool_call>`` tag. ``status`` OK: a block that ends at ``end`` (just
    past its closing tag), holding ``call`` (None: JSON that is no call of ours, so content);
    INCOMPLETE: the text ends before the block does; INVALID: no call, whatever follows."""

    status: str
    end: int = 0
    call: ToolCall | None = None


def _read_block(text: str, start: int, names: set[str] | None) -> _Block:
    """The block whose opening tag is at ``start``: JSON, then the closing tag."""
    scan = scan_json(text, start + len(_OPEN_TAG))
    if scan.status != OK:
        return _Block(scan.status)
    j = skip_whitespace(text, scan.end)
    if not text.startswith(_CLOSE_TAG, j):
        rest = text[j : j + len(_CLOSE_TAG)]
        return _Block(INCOMPLETE if len(rest) < len(_CLOSE_TAG) and _CLOSE_TAG.startswith(rest) else INVALID)
    return _Block(OK, j + len(_CLOSE_TAG), _call_of(text, scan, names))


def _call_of(text: str, scan: JSONScan, names: set[str] | None) -> ToolCall | None:
    """The call a scanned JSON value describes: ``{"name": ..., "arguments": {...}}`` with a
    name in ``names``; the arguments are the model's own text of them."""
    if not scan.is_object:
        return None
    name_m = scan.member("name")
    if name_m is None or text[name_m.start] != '"':
        return None
    name = json.loads(text[name_m.start:name_m.end])
    if names is not None and name not in names:
        return None
    args_m = scan.member("arguments") or scan.member("parameters")
    if args_m is None:
        return ToolCall(name, "{}")
    args = text[args_m.start:args_m.end]
    if args[0] == '"':  # some models write the arguments as a JSON string
        args = json.loads(args)
        inner = scan_json(args)
        if not inner.is_object or skip_whitespace(args, inner.end) != len(args):
            return None
        args = args[inner.start:inner.end]
        try:
            args.encode("utf-8")
        except UnicodeEncodeError:  # an escaped lone surrogate, now raw: no UTF-8 text
            return None
    elif args[0] != "{":
        return None
    return ToolCall(name, args)


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """``(content, calls)``: the calls the text holds, and the text around them. A block that
    is no call (not JSON, not closed, an unknown function) stays in the content; one whose
    JSON does not parse stays content up to the first closing tag. Once there are calls,
    whitespace alone between blocks is no content, and the content is stripped."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(_OPEN_TAG, pos)
        seg = text[pos:] if start < 0 else text[pos:start]
        if not (calls and not seg.strip()):
            content.append(seg)
        if start < 0:
            break
        block = _read_block(text, start, names)
        if block.status == OK:
            if block.call is None:
                content.append(text[start:block.end])
            else:
                calls.append(block.call)
            pos = block.end
            continue
        close = text.find(_CLOSE_TAG, start) if block.status != INCOMPLETE else -1
        if close < 0:
            content.append(text[start:])
            break
        content.append(text[start:close + len(_CLOSE_TAG)])
        pos = close + len(_CLOSE_TAG)
    return "".join(content).strip() if calls else "".join(content), calls


class ToolCallStream:
    """Splits streamed text into content deltas and tool-call deltas (OpenAI's chunk shape), with
    the same result as :func:`parse_tool_calls` on the whole text. Text that could be the start of
    a ``<tool_call>`` tag is held back until it is known not to be; a call is sent once its block
    is complete: first its id, type and name, then its arguments (clients concatenate
    ``arguments`` deltas per index)."""

    def __init__(self, names: set[str] | None = None):
        self.names = names
        self._buf = ""
        self.calls: list[ToolCall] = []
        # Whether text other than whitespace was sent since the last block: whitespace
        # alone between blocks (once there are calls) is no content, as in parse_tool_calls.
        self._seg_text = False
        # Length of the buffer when its block was last found incomplete: it is read again
        # only once a closing tag ends past that (nothing else can complete it), so an
        # argument full of closing tags costs one scan per tag, not one per token.
        self._incomplete_at = 0

    def _between_blocks(self, seg: str) -> str:
        """``seg``, text between blocks, as content (nothing when it is whitespace that
        only separates calls)."""
        if self.calls and not self._seg_text and not seg.strip():
            return ""
        self._seg_text = self._seg_text or bool(seg.strip())
        return seg

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._buf:
            start = self._buf.find(_OPEN_TAG)
            if start < 0:
                cut = len(self._buf) - _partial_tag_suffix(self._buf)
                if self.calls and not self._seg_text and not self._buf[:cut].strip():
                    break  # whitespace after a block: content only if more text follows
                content.append(self._between_blocks(self._buf[:cut]))
                self._buf = self._buf[cut:]
                break
            if start:
                content.append(self._between_blocks(self._buf[:start]))
                self._buf = self._buf[start:]
            # No block ends before a closing tag: until one arrives there is nothing to read.
            close = self._buf.find(_CLOSE_TAG)
            if close < 0:
                break
            if self._incomplete_at and self._buf.find(_CLOSE_TAG, self._incomplete_at - len(_CLOSE_TAG) + 1) < 0:
                break
            block = _read_block(self._buf, 0, self.names)
            if block.status == INCOMPLETE:
                self._incomplete_at = len(self._buf)
                break
            self._incomplete_at = 0
            end = block.end if block.status == OK else close + len(_CLOSE_TAG)
            if block.call is None:  # not JSON, or JSON that is no call of ours: content
                content.append(self._buf[:end])
            else:
                call, i = block.call, len(self.calls)
                self.calls.append(call)
                deltas.append({"index": i, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                deltas.append({"index": i, "function": {"arguments": call.arguments}})
            self._buf = self._buf[end:]
            self._seg_text = False
        return "".join(content), deltas

    def finish(self) -> str:
        """What is left when the output ends (an unterminated block is content)."""
        rest, self._buf = self._buf, ""
        return rest if rest.startswith(_OPEN_TAG) else self._between_blocks(rest)


def _partial_tag_suffix(s: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(s), len(_OPEN_TAG) - 1), 0, -1):
        if _OPEN_TAG.startswith(s[-n:]):
            return n
    return 0
