"""The tools of a chat request, parsed once: what the chat template shows, which calls the
answer may contain, and the grammar that shapes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from radixserve.grammar.tools import CallGrammar, Tool, ToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """Tools of a chat request and the grammar of its output: with ``tool_choice`` "required"
    (or a named function) the output is calls; with "auto" it is free text until the model
    opens a call, which the grammar then completes — unless the request brings a grammar of
    its own (``own_grammar``: response_format, regex, ebnf), which then shapes the output
    alone. A required call and a grammar of the request's own exclude each other."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool
    own_grammar: bool = False

    def __post_init__(self) -> None:
        if self.choice.mode == "required" and self.own_grammar:
            raise ValueError("tool_choice that requires a call excludes response_format, regex and ebnf")

    @cached_property
    def grammar(self) -> str | None:
        calls = CallGrammar(self.tools, self.choice, self.parallel)
        if self.choice.mode == "required":
            return calls.forced()
        return None if self.own_grammar else calls.lazy()

    @property
    def names(self) -> set[str]:
        return set(self.choice.names)

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (``tools=...``)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]
