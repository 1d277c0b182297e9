"""The tools of a chat request, parsed once: what the chat template shows, which calls the
answer may contain, and the grammar that forces a call when ``tool_choice`` requires one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.grammar.tools import Tool, ToolChoice, call_grammar


@dataclass(frozen=True)
class ToolPlan:
    """Tools of a chat request: what the template shows, and the grammar forcing a call when
    ``tool_choice`` requires one (None for "auto")."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool

    @property
    def grammar(self) -> str | None:
        if self.choice.mode != "required":
            return None
        return call_grammar(self.tools, self.choice, self.parallel)

    @property
    def names(self) -> set[str]:
        return set(self.choice.names)

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (``tools=...``)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]
