"""Flags that set a config field of the same name, written as a table of flag -> help.

`--foo-bar` sets the field `foo_bar`, unit suffix included (`--prefetch-timeout-s` sets
`prefetch_timeout_s`); the bench tools' own flags may still drop a seconds field's `_s`.
`add_config_flags` adds one flag per table row, typed and defaulted by the config (an
instance, or the dataclass itself for its class-level defaults; an enum field offers its
values as choices), its help ending with the default: a default is written once, in the
dataclass. `config_kwargs` reads the parsed values back by the same rule.

A flag renamed to its field's name keeps its old name as a deprecated alias
(`DEPRECATED_FLAGS`, listed in docs/operations.md): `add_deprecated_aliases` gives each a
hidden flag that sets the same field (and says so on stderr); a `serve --config` file
takes the old names too (launch/config_file.py).

A float flag parses with `finite_float`: nan and inf are refused with the flag's name
(argparse adds it), as every config refuses them again in `__post_init__`.

This module imports nothing of asynchicache, so every layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from enum import Enum
from types import MappingProxyType
from typing import Any

WITH_DEFAULT = " (default %(default)s)"

# Deprecated flag -> the flag of today that sets the same field (names with their unit,
# issue 43). `serve`, `asynchicache service` and `serve --config` files accept both.
DEPRECATED_FLAGS: Mapping[str, str] = MappingProxyType({
    "--startup-timeout": "--startup-timeout-s",
    "--shutdown-timeout": "--shutdown-timeout-s",
    "--engine-step-timeout": "--engine-step-timeout-s",
    "--request-timeout": "--request-timeout-s",
    "--header-timeout": "--header-timeout-s",
    "--prefetch-timeout": "--prefetch-timeout-s",
    "--prefetch-timeout-per-ki-token": "--prefetch-timeout-per-ki-token-s",
    "--storage-timeout": "--storage-timeout-s",
    "--remote-ttl": "--remote-ttl-s",
    "--client-ttl": "--client-ttl-s",
    "--socket": "--address",  # asynchicache service: ServiceConfig.address
})  # fmt: skip

log = logging.getLogger(__name__)


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


class _DeprecatedAlias(argparse.Action):
    """An old flag name: sets its new flag's field, and says which name to use."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: argparse.Action,
                 **kwargs: Any) -> None:  # fmt: skip
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        log.warning("%s is deprecated: use %s", option_string, self.new.option_strings[0])
        setattr(namespace, self.dest, self.new.const if self.nargs == 0 else values)


def add_deprecated_aliases(parser: argparse.ArgumentParser) -> None:
    """A hidden flag for each `DEPRECATED_FLAGS` name whose new flag `parser` has: the same
    field, type and choices; its default is the new flag's (argparse.SUPPRESS here)."""
    for old, new in DEPRECATED_FLAGS.items():
        action = parser._option_string_actions.get(new)
        if action is None or old in parser._option_string_actions:
            continue
        typed: dict[str, Any] = {} if action.type is None else {"type": action.type}
        parser.add_argument(
            old,
            action=_DeprecatedAlias,
            new=action,
            dest=action.dest,
            nargs=0 if action.nargs == 0 else None,
            choices=action.choices,
            metavar=action.metavar,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            **typed,
        )
