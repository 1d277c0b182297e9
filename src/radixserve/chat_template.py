"""Chat templates: one sandboxed Jinja environment for the model's tokenizer and ``lang``.

Templates are model data, hence untrusted: they run in Jinja's immutable sandbox with the
options and helpers transformers gives them (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, ``tojson``, ``raise_exception``, ``strftime_now``), so renderings match
``apply_chat_template``. Any failure inside a template — its own ``raise_exception`` (e.g.
"roles must alternate"), an undefined variable, a type error — is a
:class:`ChatTemplateError`, a ``ValueError``: the request was bad for this template, the
server answers 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "render_chat", "validate_messages"]

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


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str):  # -> jinja2.Template
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ext.loopcontrols])
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
    kw: dict[str, Any] = {"bos_token": bos_token, "eos_token": eos_token, "tools": None,
                          "documents": None}
    kw.update(variables)
    try:
        return tmpl.render(messages=msgs, add_generation_prompt=add_generation_prompt, **kw)
    except Exception as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
