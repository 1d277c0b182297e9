"""Chat templates: one sandboxed Jinja environment for the model's tokenizer and ``lang``.

Templates are model data, hence untrusted: they run in Jinja's immutable sandbox with the
options and helpers transformers gives them (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, ``tojson``, ``raise_exception``, ``strftime_now``), so renderings match
``apply_chat_template``. Any failure inside a template — its own ``raise_exception`` (e.g.
"roles must alternate"), an undefined variable, a type error — is a
:class:`ChatTemplateError`, a ``ValueError``: the request was bad for this template, the
server answers 400.

A model that ships no template is most likely a base model: it completes text and was never
trained on chat turns, so rendering them in a template of ours (ChatML, Gemma 3's) makes it
ramble. The chat API refuses such a model (:class:`ServedChatTemplate`) unless the operator
names a template (``--chat-template``, a file or the text, as vLLM takes it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "ServedChatTemplate", "load_chat_template", "render_chat",
           "validate_messages"]

# ChatML, used when a model file stores no template (and for the tiny test model).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused or failed to render these messages."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str):  # -> jinja2.Template
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:  # a template that does not even parse
        raise ChatTemplateError(f"the chat template is invalid: {e}") from None


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages up front, so a bad request fails with a message naming the field
    instead of a Jinja error deep inside a template."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append(dict(m))
    return out


def render_chat(template: str | None, messages: Any, add_generation_prompt: bool = True, *,
                bos_token: str = "", eos_token: str = "", validate: bool = True,
                **variables: Any) -> str:
    """Render ``messages`` with ``template`` (ChatML when None)."""
    msgs = validate_messages(messages) if validate else messages
    tmpl = compile_template(template or CHATML_TEMPLATE)
    kw = {"bos_token": bos_token, "eos_token": eos_token, "tools": None, "documents": None, **variables}
    try:
        return tmpl.render(messages=msgs, add_generation_prompt=add_generation_prompt, **kw)
    except Exception as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None


def load_chat_template(value: str, field: str = "chat_template") -> str:
    """A configured template: the text of the Jinja file ``value`` names, else ``value``
    itself when it is template text (holds ``{{`` or ``{%``). ValueError naming ``field``
    for a path that does not exist, a file that cannot be read, or a template that does
    not parse."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field} must be a Jinja file or the template text, got {value!r}")
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{field}: cannot read {value!r} ({e})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"{field}: no such file {value!r} (give a Jinja file or the template text)")
    try:
        compile_template(text)
    except ChatTemplateError as e:
        raise ValueError(f"{field}: {e}") from None
    return text


@dataclass(frozen=True)
class ServedChatTemplate:
    """The template chat requests are rendered with: the configured one, else the model's
    own; None when the model ships none (its tokenizer's template is a stand-in of ours)
    and none is configured — chat is then refused rather than rendered in a format the model
    never saw."""

    template: str | None

    @classmethod
    def choose(cls, model_template: str | None, model_ships_none: bool, configured: str = "") -> "ServedChatTemplate":
        if configured:
            return cls(load_chat_template(configured))
        return cls(None if model_ships_none else model_template)

    def missing_message(self, model: str) -> str:
        return (f"{model} ships no chat template (a base model: it completes text and was never trained "
                "on chat turns), so chat requests cannot be rendered; start the server with "
                "--chat-template (a Jinja file or the template text), or send text to /v1/completions")
