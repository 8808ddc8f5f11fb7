"""`serve --config FILE.yaml`: a YAML mapping of flag names to values, read as the flags'
defaults (so the command line wins), each value checked as the flag would parse it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _file_value(action: argparse.Action, key: str, value: Any, path: Path) -> Any:
    """A config-file value as the flag would have parsed it (same types and choices)."""
    where = f"--config {path}: {key}"
    if action.nargs == 0:  # a switch such as --no-disk-cache: true means "given"
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: use true or false, got {value!r}")
        return action.const if value else action.default
    if value is None:
        return None
    if isinstance(value, dict | list | bool):
        raise ValueError(f"{where} must be a single value, got {value!r}")
    try:
        parsed = action.type(value) if callable(action.type) else value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(f"{where} must be one of {list(action.choices)}, got {value!r}")
    return parsed


def config_file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Flag defaults from a YAML file: `{dest: value}`; unknown keys are an error."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    # By the flag's name (`no-arrival-prefetch`, `hicache-ratio`), not its dest: ours with
    # - or _ alike; other servers' flags (dest compat_*) as they spell them, where ours
    # with the same name in the other spelling wins (LightLLM's disk_cache_dir means ours).
    actions: dict[str, argparse.Action] = {}
    for a in parser._actions:
        for opt in a.option_strings if a.dest not in ("help", "config") else ():
            theirs = a.dest.startswith("compat_")
            actions.setdefault(opt.lstrip("-") if theirs else _key(opt), a)
    out: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(_key(str(key))) or actions.get(str(key).lstrip("-"))
        if action is None:
            known = ", ".join(sorted(k.replace("_", "-") for k in actions))
            raise ValueError(f"--config {path}: unknown flag {key!r}; known: {known}")
        out[action.dest] = _file_value(action, str(key), value, path)
    return out


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
