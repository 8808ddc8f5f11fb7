"""`serve --config FILE.yaml`: a YAML mapping of flag names to values, read as the flags'
defaults (so the command line wins), each value checked as the flag would parse it.

A key is a flag's name without its dashes, `-` or `_` alike (`disk-cache-gb`,
`disk_cache_gb`: the field's own name), so one setting has one name from flag to YAML to
config field; a flag's deprecated name (config_flags.DEPRECATED_FLAGS) is read as its new
one, and a setting given under both names is an error. `accepted_keys` lists them all.

A value must have the flag's type as YAML reads it: a string flag (`api-key`, `host`,
`model`...) takes a string only, so `api-key: 12345` (a YAML integer; `012345` would
even be octal) is an error naming the key rather than a key that never matches; an
integer flag takes an integer (not 80.5, not true); a float flag a finite number (not
.nan or .inf). A key given twice is an error (YAML itself keeps the last one silently).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from asynchicache.settings.config_flags import DEPRECATED_FLAGS

log = logging.getLogger(__name__)


def _typed(action: argparse.Action, value: Any, where: str) -> Any:
    """`value` if YAML gave the type the flag parses, else a ValueError naming the key."""
    if isinstance(value, str):
        return value  # parsed by the flag's own type below, as on the command line
    kind = action.type
    number = isinstance(value, Real) and not isinstance(value, bool)
    if kind is int and number and isinstance(value, Integral):
        return str(value)
    if kind not in (None, int, str, Path) and number:
        return repr(value)  # a float flag: its type refuses nan and inf
    wanted = "an integer" if kind is int else "a string" if kind in (None, str, Path) else (
        "a number")  # fmt: skip
    hint = "; quote it" if kind in (None, str, Path) else ""
    raise ValueError(f"{where} must be {wanted}{hint}, got {value!r}")


def _file_value(action: argparse.Action, key: str, value: Any, path: Path) -> Any:
    """A config-file value as the flag would have parsed it (same types and choices)."""
    where = f"--config {path}: {key}"
    if action.nargs == 0:  # a switch such as --no-disk-cache: true means "given"
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: use true or false, got {value!r}")
        return action.const if value else action.default
    if value is None:
        return None
    if isinstance(value, dict | list):
        raise ValueError(f"{where} must be a single value, got {value!r}")
    text = _typed(action, value, where)
    try:
        parsed = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(f"{where} must be one of {list(action.choices)}, got {value!r}")
    return parsed


def _duplicate_keys(text: str) -> list[str]:
    """Keys given more than once in the top-level mapping (YAML keeps the last silently)."""
    import yaml

    node = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes only: nothing is built
    if not isinstance(node, yaml.MappingNode):
        return []
    seen: set[str] = set()
    twice = []
    for key, _value in node.value:
        name = str(key.value).lstrip("-").replace("-", "_")
        if name in seen:
            twice.append(str(key.value))
        seen.add(name)
    return twice


def config_file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Flag defaults from a YAML file: `{dest: value}`; unknown or repeated keys are an
    error."""
    import yaml

    try:
        text = path.read_text()
        twice = _duplicate_keys(text)
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    if twice:
        raise ValueError(f"--config {path}: {', '.join(map(repr, twice))} given more than once")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    actions = accepted_keys(parser)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # dest -> the key that set it
    for key, value in data.items():
        action = actions.get(_key(str(key))) or actions.get(str(key).lstrip("-"))
        if action is None:
            old = {_key(flag) for flag in DEPRECATED_FLAGS}  # accepted, not advertised
            known = ", ".join(sorted(k.replace("_", "-") for k in actions if k not in old))
            raise ValueError(f"--config {path}: unknown flag {key!r}; known: {known}")
        if action.dest in given:
            first = given[action.dest]
            raise ValueError(
                f"--config {path}: {first!r} and {key!r} set the same flag (one is the other's "
                "deprecated name); give one"
            )
        new = DEPRECATED_FLAGS.get("--" + _key(str(key)).replace("_", "-"))
        if new is not None:
            log.warning("--config %s: %s is deprecated: use %s", path, key, new.lstrip("-"))
        given[action.dest] = str(key)
        out[action.dest] = _file_value(action, str(key), value, path)
    return out


def accepted_keys(parser: argparse.ArgumentParser) -> Mapping[str, argparse.Action]:
    """Every key a `--config` file may hold -> the flag (action) it sets.

    By the flag's name (`no-arrival-prefetch`, `hicache-ratio`), not its dest: ours with
    - or _ alike (keyed by the `_` spelling); other servers' flags (dest compat_*) as they
    spell them, where ours with the same name in the other spelling wins (LightLLM's
    disk_cache_dir means ours). A deprecated name maps to its new flag's action."""
    actions: dict[str, argparse.Action] = {}
    flags = parser._option_string_actions
    for action in parser._actions:
        for opt in action.option_strings if action.dest not in ("help", "config") else ():
            theirs = action.dest.startswith("compat_")
            sets = flags.get(DEPRECATED_FLAGS.get(opt, opt), action)
            actions.setdefault(opt.lstrip("-") if theirs else _key(opt), sets)
    return actions


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
