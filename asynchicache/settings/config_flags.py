"""Flags that set a config field of the same name, written as a table of flag -> help.

`--foo-bar` sets the field `foo_bar`, or `foo_bar_s` (seconds). `add_config_flags` adds one
flag per table row, typed and defaulted by the config (an instance, or the dataclass itself
for its class-level defaults; an enum field offers its values as choices), its help ending
with the default: a default is written once, in the dataclass. `config_kwargs` reads the
parsed values back by the same rule.

A float flag parses with `finite_float`: nan and inf are refused with the flag's name
(argparse adds it), as every config refuses them again in `__post_init__`.

This module imports nothing of asynchicache, so every layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from enum import Enum
from typing import Any

WITH_DEFAULT = " (default %(default)s)"


def finite_float(text: str) -> float:
    """A flag's float: a finite number (argparse names the flag in its error)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def add_config_flags(
    group: argparse._ActionsContainer, config: object, helps: Mapping[str, str]
) -> None:
    """One flag per `helps` entry, typed and defaulted by `config`'s field of its name."""
    for flag, text in helps.items():
        dest = flag.lstrip("-").replace("-", "_")
        default = getattr(config, dest) if hasattr(config, dest) else getattr(config, dest + "_s")
        kw: dict[str, Any] = {"default": default}
        if isinstance(default, Enum):
            kw.update(default=default.value, choices=[x.value for x in type(default)])
        elif isinstance(default, float):
            kw["type"] = finite_float
        elif not isinstance(default, str):
            kw["type"] = type(default)
        group.add_argument(flag, help=text + WITH_DEFAULT, **kw)


def config_argv(config: object, helps: Mapping[str, str]) -> list[str]:
    """The flags of `helps` that set `config`'s values (what `add_config_flags` parses back)."""
    argv = []
    for flag in helps:
        dest = flag.lstrip("-").replace("-", "_")
        value = getattr(config, dest) if hasattr(config, dest) else getattr(config, dest + "_s")
        argv += [flag, str(value.value if isinstance(value, Enum) else value)]
    return argv


def config_kwargs(cls: type, args: argparse.Namespace, **given: Any) -> dict[str, Any]:
    """`given`, plus each other field of dataclass `cls` that a flag of its name set."""
    kwargs = dict(given)
    for f in dataclasses.fields(cls):
        for dest in (f.name, f.name.removesuffix("_s")):
            if f.name not in kwargs and hasattr(args, dest):
                kwargs[f.name] = getattr(args, dest)
    return kwargs
