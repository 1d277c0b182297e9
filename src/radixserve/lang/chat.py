"""Role blocks (``system``/``user``/``assistant``) rendered by the model's own chat template.

A program writes a message piece by piece (``s += assistant(gen("a"))``: the content is not
known when the block opens), so we need the text that *opens* and *closes* a role block,
not one rendered message. We get both from the template itself, exactly: render the
history plus one message whose content is a unique marker, subtract the rendering of the
history alone (the delta), and split the delta at the marker. For ChatML-style templates
(each message rendered independently) this is byte-exact, including a default system
prompt that some templates (SmolLM2) insert before the first non-system message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.chat_template import render_chat

_MARKER = "\x00RADIXSERVE_ROLE_CONTENT\x00"

RenderFn = Callable[[list[dict[str, str]], bool], str]


def template_renderer(template: str | None, bos_token: str = "", eos_token: str = "") -> RenderFn:
    """A render function for a template string (ChatML when ``None``)."""
    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return render_chat(template, messages, add_generation_prompt, bos_token=bos_token,
                           eos_token=eos_token, validate=False)

    return render


class ChatFormat:
    """Opening/closing text of role blocks, derived from a chat template by rendering deltas."""

    def __init__(self, render: RenderFn):
        self._render = render

    def _safe_render(self, messages: list[dict[str, str]]) -> str:
        return self._render(messages, False) if messages else ""

    def role_delimiters(self, history: list[dict[str, str]], role: str) -> tuple[str, str]:
        """(begin, end) text of a ``role`` block that follows ``history`` (earlier messages). Falls
        back to rendering the block after a dummy system message when the history's rendering is not
        a prefix of the longer one (templates that rewrite earlier turns): the text already in the
        state cannot be changed, so that is the best available."""
        before = self._safe_render(history)
        after = self._safe_render([*history, {"role": role, "content": _MARKER}])
        if not after.startswith(before):
            dummy = [{"role": "system", "content": "x"}]
            before = self._safe_render(dummy)
            after = self._safe_render([*dummy, {"role": role, "content": _MARKER}])
            if not after.startswith(before):
                before = ""
                after = self._safe_render([{"role": role, "content": _MARKER}])
        delta = after[len(before) :]
        if _MARKER not in delta:
            raise ValueError(f"the chat template drops the content of a {role!r} message")
        begin, _, end = delta.partition(_MARKER)
        return begin, end


def refusing_renderer(reason: str) -> RenderFn:
    """A render function for a model without a chat template: role blocks fail with
    ``reason`` (a base model never saw chat turns; text and ``gen`` still work)."""

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        raise ValueError(reason)

    return render


def engine_renderer(tokenizer: Any) -> RenderFn:
    """A render function that uses the engine tokenizer's ``apply_chat_template``."""

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    return render
