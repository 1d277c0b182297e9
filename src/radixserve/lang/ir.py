"""The expressions a program appends to its state: ``s += <expr>``.

Expressions are plain data. Building one (``gen("x", max_tokens=8)``) does no work and
validates its arguments at once, so a malformed program fails at the line that wrote it,
not later inside a worker thread. The state's executor interprets them in order
(see ``state.py``); backends only ever see prompt text and :class:`GenParams`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

# How ``select`` turns the per-token logprobs of a choice into one score. SGLang's default
# is the token-length-normalized mean: with the plain sum, longer choices lose just for
# having more tokens.
CHOICES_METHODS = ("token_length_normalized", "sum")


class Expr:
    """Base of everything ``s += ...`` accepts (a ``str`` is wrapped in :class:`Text`). ``a + b``
    concatenates expressions, so ``s += "Q: " + q + "\\nA:" + gen("a")`` works."""

    def __add__(self, other: object) -> "ExprList":
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: object) -> "ExprList":
        return ExprList([to_expr(other), self])


@dataclass(eq=False)
class Text(Expr):
    """Constant text appended verbatim."""

    text: str


@dataclass(eq=False)
class ExprList(Expr):
    """Several expressions appended one after another."""

    items: list[Expr]

    def __add__(self, other: object) -> "ExprList":
        return ExprList([*self.items, to_expr(other)])

    def __radd__(self, other: object) -> "ExprList":
        return ExprList([to_expr(other), *self.items])


@dataclass
class GenParams:
    """Sampling options of one ``gen``; ``None`` means "use the run's default". Field names follow
    SGLang's ``gen`` (``max_tokens``); backends map them to the engine's ``SamplingParams`` or to
    the native HTTP API's ``sampling_params`` (``max_new_tokens``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] | None = None
    ignore_eos: bool | None = None
    # Structured output (at most one): the text generated must match it.
    regex: str | None = None
    json_schema: str | None = None  # JSON text, as SGLang's frontend sends it
    ebnf: str | None = None

    def merged_over(self, defaults: "GenParams") -> "GenParams":
        """These options with every unset field taken from ``defaults``."""
        return GenParams(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                            else getattr(defaults, f.name) for f in fields(self)})

    def to_dict(self) -> dict:
        """Set fields only (what a backend forwards)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


# What a run uses when neither the gen nor the run sets a field (SGLang's defaults).
DEFAULT_GEN_PARAMS = GenParams(max_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)


@dataclass(eq=False)
class Gen(Expr):
    """Generate text from the current state and store it in variable ``name``."""

    name: str | None
    params: GenParams = field(default_factory=GenParams)


@dataclass(eq=False)
class Select(Expr):
    """Append the choice the model finds most likely after the current text."""

    name: str | None
    choices: list[str]
    choices_method: str = "token_length_normalized"


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


def to_expr(x: object) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(f"cannot append {type(x).__name__} to a program state; use a str or gen/select/role expressions")


def _check_name(name: object, what: str) -> str | None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{what} name must be a non-empty string or None, got {name!r}")
    return name


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | Sequence[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, choices: Sequence[str] | None = None,
        choices_method: str = "token_length_normalized", regex: str | None = None,
        json_schema: str | dict | None = None, ebnf: str | None = None) -> Expr:
    """Generate text into variable ``name`` (``s[name]``). As in SGLang,
    ``gen(name, choices=[...])`` is a :func:`select`. ``regex``, ``json_schema`` (a dict or JSON
    text) or ``ebnf`` constrain the text to match."""
    if choices is not None:
        return select(name, choices=choices, choices_method=choices_method)
    _check_name(name, "gen")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"gen({name!r}): max_tokens must be an int >= 0, got {max_tokens!r}")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0
                                    or not math.isfinite(temperature)):
        raise ValueError(f"gen({name!r}): temperature must be a finite number >= 0, got {temperature!r}")
    return Gen(name, GenParams(
        **_gen_grammar(name, regex, json_schema, ebnf), max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, stop=_gen_stops(name, stop), ignore_eos=ignore_eos))


def _gen_stops(name: str | None, stop: str | Sequence[str] | None) -> list[str] | None:
    if stop is None or isinstance(stop, str):
        return None if stop is None else [stop]
    stop_list = list(stop)
    if not all(isinstance(x, str) and x for x in stop_list):
        raise ValueError(f"gen({name!r}): stop must be a string or a list of non-empty strings")
    return stop_list


def _gen_grammar(name: str | None, regex: str | None, json_schema: str | dict | None,
                 ebnf: str | None) -> dict[str, str | None]:
    """At most one grammar, as ``GenParams`` fields (a JSON schema dict as its text)."""
    grammar = {k: v for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf)) if v is not None}
    if len(grammar) > 1:
        raise ValueError(f"gen({name!r}): give at most one of regex, json_schema and ebnf")
    for k in ("regex", "ebnf"):
        if k in grammar and (not isinstance(grammar[k], str) or not grammar[k]):
            raise ValueError(f"gen({name!r}): {k} must be a non-empty string")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    return {"regex": regex, "json_schema": json_schema, "ebnf": ebnf}


def select(name: str | None = None, choices: Sequence[str] | None = None,
           choices_method: str = "token_length_normalized") -> Select:
    """Pick one of ``choices`` by log-probability given the text so far; store it in ``name``.
    ``choices_method``: ``"token_length_normalized"`` (default, SGLang's: mean logprob of the
    choice's tokens) or ``"sum"`` (total logprob)."""
    _check_name(name, "select")
    if choices is None or isinstance(choices, str) or len(choices) == 0:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices, got {choices!r}")
    cl = list(choices)
    for c in cl:
        if not isinstance(c, str) or not c:
            raise ValueError(f"select({name!r}): every choice must be a non-empty string, got {c!r}")
    if choices_method not in CHOICES_METHODS:
        raise ValueError(f"select({name!r}): choices_method must be one of {CHOICES_METHODS}, "
                         f"got {choices_method!r}")
    return Select(name, cl, choices_method)


def _role(role: str, content: object) -> Expr:
    inner = [] if content is None else [to_expr(content)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(content: object = None) -> Expr:
    """A system message in the model's chat template (``content``: str or expressions)."""
    return _role("system", content)


def user(content: object = None) -> Expr:
    """A user message in the model's chat template."""
    return _role("user", content)


def assistant(content: object = None) -> Expr:
    """An assistant message; ``assistant(gen("answer"))`` generates the reply in place."""
    return _role("assistant", content)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def flatten(expr: Expr) -> list[Expr]:
    """The leaf expressions of ``expr`` in order."""
    if isinstance(expr, ExprList):
        out: list[Expr] = []
        for e in expr.items:
            out.extend(flatten(e))
        return out
    return [expr]
