"""Command-line flags generated from a config dataclass: the one generator of every command.

One ``--flag`` per field (``--x/--no-x`` for a bool, repeatable for a tuple), its help text
from a help table, its choices from a choices table; every flag defaults to None, meaning
"the config's default", so a value is validated once, by the dataclass. A new config field
is a new flag with no edit here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["add_config_flags", "given_options"]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str, help: Mapping[str, str],
                     choices: Mapping[str, Sequence[str]] = {}, skip: Sequence[str] = (),
                     aliases: Mapping[str, Sequence[str]] = {}) -> None:
    """One flag per field of the dataclass ``cls`` (but ``skip``), in a group ``title``."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = _default(f)
        shown = "none" if default in ("", None) else default
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{help.get(f.name, f.name)} (default: {shown})"}
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, tuple):
            kw["action"], kw["metavar"] = "append", "VALUE"
        elif isinstance(default, int):
            kw["type"], kw["metavar"] = int, "N"
        elif isinstance(default, float):
            kw["type"], kw["metavar"] = float, "X"
        if f.name in choices:
            kw["choices"] = list(choices[f.name])
        group.add_argument("--" + f.name.replace("_", "-"), *aliases.get(f.name, ()), **kw)


def given_options(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` the user gave on the command line (the rest keep their defaults)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
