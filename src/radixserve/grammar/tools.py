"""OpenAI tool calls: what the model is told, the grammar that forces a call, the parser.

The call format is the one Hermes-style chat templates (Qwen2.5, Hermes, SmolLM3, ...) teach
their models, one JSON object per call between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose template knows ``tools`` gets them through the template; any other (SmolLM2's
ChatML) gets the same description as a system message. With ``tool_choice`` "required" or a
named function the output is constrained by a grammar built from the tools' parameter
schemas, so it always parses; with "auto" the model may answer or call, and the parser finds
the calls in what it wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"

#: JSON inside a call is written as ``json.dumps`` writes it (see grammar/compiler.py).
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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


def call_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool) -> str:
    """A Lark grammar (llguidance dialect, with ``%json``) whose sentences are one call — or,
    with ``parallel``, up to :data:`MAX_PARALLEL_CALLS` — of the allowed functions."""
    allowed = [t for t in tools if t.name in choice.names]
    alts = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _closed(t.parameters)},
             "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
    schema: dict[str, Any] = alts[0] if len(alts) == 1 else {"anyOf": alts}
    schema = {**schema, "x-guidance": _X_GUIDANCE}
    lines = [
        "start: call" + "".join(' ("\\n" call)?' for _ in range(MAX_PARALLEL_CALLS - 1)) if parallel
        else "start: call",
        f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}",
        f"body: %json {json.dumps(schema, ensure_ascii=False)}",
    ]
    return "\n".join(lines) + "\n"


def _closed(params: dict[str, Any]) -> dict[str, Any]:
    """Arguments beyond the declared ones are useless to a tool: a forced call writes only
    the declared ones (unless the schema says otherwise)."""
    if params.get("type") == "object" and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
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


def _parse_call(body: str, names: set[str] | None) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """``(content, calls)``: the calls the text holds, and the text around them. A block
    that does not parse (or names an unknown function) stays in the content."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(_OPEN_TAG, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(_CLOSE_TAG, start)
        if end < 0:
            content.append(text[pos:])
            break
        call = _parse_call(text[start + len(_OPEN_TAG):end].strip(), names)
        if call is None:
            content.append(text[pos:end + len(_CLOSE_TAG)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = end + len(_CLOSE_TAG)
    return "".join(content).strip() if calls else "".join(content), calls


class ToolCallStream:
    """Splits streamed text into content deltas and tool-call deltas (OpenAI's chunk shape).

    Text that could be the start of a ``<tool_call>`` tag is held back until it is known not
    to be; a call is sent once its block is complete: first its id, type and name, then its
    arguments (clients concatenate ``arguments`` deltas per index)."""

    def __init__(self, names: set[str] | None = None):
        self.names = names
        self._buf = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._buf:
            start = self._buf.find(_OPEN_TAG)
            if start < 0:
                keep = _partial_tag_suffix(self._buf)
                if self.calls and not self._buf[: len(self._buf) - keep].strip():
                    break  # whitespace after a call: content only if more text follows
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if start:
                seg = self._buf[:start]
                if not (self.calls and not seg.strip()):  # newlines between calls are not content
                    content.append(seg)
                self._buf = self._buf[start:]
            end = self._buf.find(_CLOSE_TAG)
            if end < 0:
                break  # the call is still being written
            block = self._buf[: end + len(_CLOSE_TAG)]
            self._buf = self._buf[end + len(_CLOSE_TAG):]
            call = _parse_call(block[len(_OPEN_TAG):-len(_CLOSE_TAG)].strip(), self.names)
            if call is None:
                content.append(block)
                continue
            i = len(self.calls)
            self.calls.append(call)
            deltas.append({"index": i, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return "".join(content), deltas

    def finish(self) -> str:
        """What is left when the output ends (an unterminated block is content)."""
        rest, self._buf = self._buf, ""
        return rest if not (self.calls and not rest.strip()) else ""


def _partial_tag_suffix(s: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(s), len(_OPEN_TAG) - 1), 0, -1):
        if _OPEN_TAG.startswith(s[-n:]):
            return n
    return 0
