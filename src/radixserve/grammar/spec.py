"""What a request asks its output to match, as plain data that crosses the wire.

A :class:`GrammarSpec` is a kind and a text. JSON schemas travel as JSON text (``json.dumps``
of the parsed schema), so the compiled-grammar cache keys on the exact text in every
process. Size is bounded here, before anything is compiled: a huge grammar is refused with a
message, never left to run the compiler out of memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Grammar kinds: ``json_schema`` (a JSON Schema), ``regex`` (Rust regex syntax, matched
#: whole), ``ebnf`` (GBNF as llama.cpp writes it, or Lark as llguidance reads it).
KINDS = ("json_schema", "regex", "ebnf")

#: Longest grammar text accepted (characters). Bigger grammars cost seconds to compile and
#: megabytes per request; none of the APIs' real uses comes near this.
MAX_GRAMMAR_CHARS = 100_000

#: Most object properties a JSON schema may declare, counted over all its objects (and over
#: all tools of a request together). Compiling an object's properties costs time quadratic in
#: their number (7,600 optional properties, 95 KB of schema: seconds of compile, and then the
#: parser's limits fail it anyway): this bounds the work before any is done. OpenAI's own
#: limit is 5,000 properties.
MAX_SCHEMA_PROPERTIES = 2_000

#: JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): the model cannot
#: wander into endless whitespace, and more of the output is forced (fast-forwarded).
#: A schema's own ``x-guidance`` options override these; a tool call's JSON is written so too.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: "Any JSON object" (OpenAI's ``response_format: {"type": "json_object"}``).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid, unsupported, too large, or matching nothing.
    ``field`` names the request field the grammar came from, so the HTTP layer can answer 400 with
    ``param`` set."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar: ``kind`` in :data:`KINDS`, ``text`` its source."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {KINDS}")
        if not isinstance(self.text, str):
            raise GrammarError(f"{self.kind} must be a string, got {type(self.text).__name__}", self.kind)
        if not self.text.strip():
            raise GrammarError(f"{self.kind} must not be empty", self.kind)
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"{self.kind} has {len(self.text)} characters; the limit is {MAX_GRAMMAR_CHARS} "
                "(grammar too large)", self.kind)

    @property
    def key(self) -> tuple[str, str]:
        """Cache key: the same text compiles to the same grammar."""
        return (self.kind, self.text)


def schema_text(schema: Any, field: str = "json_schema") -> str:
    """A JSON schema given as a dict or as JSON text, as canonical JSON text. Text is parsed and
    re-serialised (keys in their given order: property order is output order) so that equal schemas
    share one compiled grammar and a schema that is not JSON fails here with the field's name."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{field} is not valid JSON: {e}", field) from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError(f"{field} must be a JSON object (a JSON Schema), got {type(schema).__name__}",
                               field)
        check_schema_size(schema, field)
        return json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        # Python's json module recurses once per level: ~1,000 levels exhaust the stack.
        raise GrammarError(f"{field} is nested too deeply", field) from None


def schema_properties(schema: Any) -> int:
    """How many object properties ``schema`` declares, in all its subschemas (``$defs``,
    ``anyOf``, ``items``... anything holding a ``properties`` object). Iterative: a schema
    nested deeply must not exhaust the stack here."""
    count = 0
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                count += len(props)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return count


def check_schema_size(schema: Any, field: str) -> None:
    """GrammarError naming ``field`` if ``schema`` (one schema, or a list of them counted
    together) declares more than :data:`MAX_SCHEMA_PROPERTIES` properties."""
    n = schema_properties(schema)
    if n > MAX_SCHEMA_PROPERTIES:
        raise GrammarError(f"{field} has {n} object properties; the limit is {MAX_SCHEMA_PROPERTIES} "
                           "(schema too large)", field)
