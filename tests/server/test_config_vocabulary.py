"""One name per setting (issue 43): every `serve` flag, every key of a `serve --config`
file, every `asynchicache service` flag and every key of the vLLM connector's
`kv_connector_extra_config` maps to exactly one config dataclass field, named as the
setting is named everywhere (unit included: `--prefetch-timeout-s` sets
`prefetch_timeout_s`), and no two names reach one field except the declared ones: the
deprecated names of earlier releases (`DEPRECATED_FLAGS`, the connector's `OLD_KEYS`),
the `--no-X` switch beside a setting's own flag, and other servers' flags
(launch/compat_flags.py, docs/migrating.md). A key the connector shares with `serve`
takes serve's default, or declares an override with its reason.

The walk reads the real parsers (`build_parser()`, the service's `_parser()`), the YAML
loader's own key table (`accepted_keys`) and `ConnectorConfig`'s fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from asynchicache.common.disk_admission import DiskAdmission
from asynchicache.integrations.vllm.connector_config import (
    OLD_KEYS,
    SERVE_SETTINGS,
    VLLM_OVERRIDES,
    ConnectorConfig,
)
from asynchicache.launch.compat_flags import COMPAT_FLAGS
from asynchicache.launch.config_file import accepted_keys, config_file_defaults
from asynchicache.launch.flags import build_parser
from asynchicache.launch.options import parse_args, to_config
from asynchicache.settings.config import (
    CacheConfig,
    EngineConfig,
    LaunchConfig,
    ServerConfig,
    ServiceTuning,
)
from asynchicache.settings.config_flags import DEPRECATED_FLAGS
from asynchicache.storage.disk.disk_config import DiskConfig
from asynchicache.storage.service.service_cli import _parser as service_parser
from asynchicache.storage.service.service_config import ServiceConfig
from asynchicache.storage.service.tiered import RemoteTierConfig, TieredConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"

SERVE_CONFIGS = (ServerConfig, EngineConfig, CacheConfig, ServiceTuning, LaunchConfig)
LAUNCH_PARTS = {"server", "engine", "cache", "service"}  # LaunchConfig's sub-configs
# `--no-X` turns off the setting X (or enable_X) and is its second name; --no-disk-cache
# turns L3 off by dropping its folder.
OFF_SWITCH_FIELDS = {"--no-disk-cache": "disk_cache_dir"}
# Set only by other servers' flags (--hiradix_cache_token_num, --hicache-ratio): L2 in
# tokens, where ours size it in GiB.
COMPAT_ONLY_FIELDS = {"host_cache_tokens"}
# The service's flags that set no field of one name: its own logging (set before any
# config is built), and its CURVE certificate and clients folder (one CurveKeys field).
SERVICE_PROCESS_FLAGS = {"--log-level": None, "--curve-secret-key": "curve",
                         "--curve-clients": "curve"}  # fmt: skip
SERVICE_CONFIGS = (CacheConfig, ServiceTuning, ServiceConfig)


def _fields(configs: Iterable[type]) -> dict[str, list[type]]:
    """Field name -> the configs that have a field of that name."""
    out: dict[str, list[type]] = defaultdict(list)
    for cls in configs:
        for f in dataclasses.fields(cls):
            if not (cls is LaunchConfig and f.name in LAUNCH_PARTS):
                out[f.name].append(cls)
    return out


def _field_of(flag: str, action: argparse.Action, fields: Mapping[str, list[type]]) -> str:
    """The one field `flag` sets, by the rule: its name is the field's (`--no-X`: X or
    enable_X, a switch); a deprecated name is its new flag's."""
    flag = DEPRECATED_FLAGS.get(flag, flag)
    if flag in OFF_SWITCH_FIELDS:
        return OFF_SWITCH_FIELDS[flag]
    name = flag.lstrip("-").replace("-", "_")
    candidates = [name] if name in fields else []
    if not candidates and name.startswith("no_") and action.nargs == 0:
        rest = name.removeprefix("no_")
        candidates = [c for c in (rest, "enable_" + rest) if c in fields]
    assert len(candidates) == 1, f"{flag} names no config field ({name}, not in {sorted(fields)})"
    field = candidates[0]
    assert action.dest in (field, name), f"{flag} parses into {action.dest}, not {field}"
    return field


def _our_flags(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """(flag, action) for every flag of ours (not other servers', not --help/--config)."""
    return [(opt, a) for a in parser._actions for opt in a.option_strings
            if a.dest not in ("help", "config") and not a.dest.startswith("compat_")]  # fmt: skip


def _one_name_per_field(names: Mapping[str, str]) -> None:
    """`names`: name -> field; no field has two names but the declared ones."""
    by_field: dict[str, list[str]] = defaultdict(list)
    for name, field in names.items():
        if name not in DEPRECATED_FLAGS and name not in OFF_SWITCH_FIELDS:
            by_field[field].append(name)
    twice = {field: names for field, names in by_field.items() if len(names) > 1}
    assert not twice, f"fields with two names: {twice}"


def test_every_field_name_is_one_setting() -> None:
    """A name read back into several configs (config_kwargs reads by name) would be one
    flag setting two things."""
    shared = {name: cls for name, cls in _fields(SERVE_CONFIGS).items() if len(cls) > 1}
    assert not shared


def test_every_serve_flag_sets_one_field() -> None:
    fields = _fields(SERVE_CONFIGS)
    names = {flag: _field_of(flag, action, fields) for flag, action in _our_flags(build_parser())}
    _one_name_per_field(names)
    assert len(names) > 60  # the walk saw the whole parser
    missing = set(fields) - set(names.values()) - COMPAT_ONLY_FIELDS
    assert not missing, f"settings without a flag: {sorted(missing)}"


def test_other_servers_flags_are_the_compat_table() -> None:
    """Their flags (declared aliases with their own meanings) are COMPAT_FLAGS' rows."""
    theirs = {opt for a in build_parser()._actions if a.dest.startswith("compat_")
              for opt in a.option_strings}  # fmt: skip
    rows = {row.flag for row in COMPAT_FLAGS if row.registered}
    assert theirs == rows


def test_deprecated_flags_set_their_new_flags_field() -> None:
    parser = build_parser()
    flags = parser._option_string_actions
    service = service_parser()._option_string_actions
    for old, new in DEPRECATED_FLAGS.items():
        actions = flags if new in flags else service
        assert old in actions, f"{old} is not accepted any more"
        assert actions[old].dest == actions[new].dest
        assert actions[old].help == argparse.SUPPRESS  # --help shows today's name only


def test_a_deprecated_flag_gives_the_config_its_new_name_gives() -> None:
    pairs = [(old, new) for old, new in DEPRECATED_FLAGS.items() if old != "--socket"]
    value = {"--remote-ttl-s": "60"}
    old_argv = ["--device", "cpu", "--remote-url", "redis://127.0.0.1:6379/0"]
    new_argv = list(old_argv)
    for old, new in pairs:
        old_argv += [old, value.get(new, "7.5")]
        new_argv += [new, value.get(new, "7.5")]
    new_config = to_config(parse_args(new_argv), {})
    assert to_config(parse_args(old_argv), {}) == new_config
    assert new_config.storage_timeout_s == 7.5 and new_config.server.header_timeout_s == 7.5


def test_every_config_file_key_sets_one_field(tmp_path: Path) -> None:
    parser = build_parser()
    fields = _fields(SERVE_CONFIGS)
    compat = {row.name.lstrip("-") for row in COMPAT_FLAGS if row.registered}
    names = {}
    for key, action in accepted_keys(parser).items():
        if action.dest.startswith("compat_"):
            assert key in compat
            continue
        flag = "--" + key.replace("_", "-")
        assert flag in parser._option_string_actions, f"YAML key {key} is no flag"
        field = _field_of(flag, parser._option_string_actions[flag], fields)
        new = DEPRECATED_FLAGS.get(flag, flag)
        assert field == _field_of(new, action, fields), f"YAML {key} sets what {new} does not"
        names[flag] = field
    _one_name_per_field(names)
    assert set(names) == {flag for flag, _ in _our_flags(parser)}


def test_a_config_file_takes_a_field_name_and_an_old_name_alike(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    parser = build_parser()
    for text in ("storage_timeout_s: 4.5\n", "storage-timeout-s: 4.5\n", "storage-timeout: 4.5\n"):
        path.write_text(text)
        assert config_file_defaults(parser, path) == {"storage_timeout_s": 4.5}
    path.write_text("storage-timeout: 4.5\nstorage-timeout-s: 5\n")
    with pytest.raises(ValueError, match="set the same flag"):
        config_file_defaults(parser, path)


def test_every_service_flag_sets_one_field() -> None:
    """`asynchicache service`: the same names as serve's for the settings both have."""
    fields = _fields(SERVICE_CONFIGS)
    serve = build_parser()._option_string_actions
    names = {}
    for flag, action in _our_flags(service_parser()):
        if flag in SERVICE_PROCESS_FLAGS:
            field = SERVICE_PROCESS_FLAGS[flag]
            assert field is None or field in fields
            continue
        names[flag] = _field_of(flag, action, fields)
        if flag in serve and flag != "--log-level":
            assert serve[flag].dest == action.dest, f"{flag}: serve and the service differ"
    _one_name_per_field(names)


@pytest.mark.parametrize(
    ("config", "own"),
    [
        # The service's own: where it listens, O_DIRECT, its starter, L4, CURVE.
        (ServiceConfig, {"address", "direct_io", "leased_by", "remote", "curve"}),
        # One namespace's store: its name, page layout, scan wait, keys; O_DIRECT.
        (DiskConfig, {"namespace", "layout", "direct_io", "scan_wait_s", "keys"}),
    ],
)
def test_the_service_and_disk_configs_name_each_setting_as_serve_does(
    config: type, own: set[str]
) -> None:
    """They copy CacheConfig's and ServiceTuning's settings under the same names (were:
    capacity_bytes, sync, key_file, encrypt, root)."""
    serve = set(_fields(SERVE_CONFIGS)) | {"disk_cache_bytes"}  # CacheConfig's, in bytes
    names = {f.name for f in dataclasses.fields(config)}
    assert names - own <= serve, sorted(names - own - serve)
    assert isinstance(CacheConfig.disk_cache_bytes, property)


def test_the_admission_threshold_has_one_name() -> None:
    """Was disk_admit_hits, admit_hits, min_hits (and _tokens alike)."""
    for cls in (CacheConfig, DiskAdmission, TieredConfig, RemoteTierConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        assert {"disk_admit_hits", "disk_admit_tokens"} <= names, cls
        assert not names & {"admit_hits", "admit_tokens", "min_hits", "min_tokens"}, cls


def _default(cls: type, name: str) -> object:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory
    return f.default


def test_every_connector_key_sets_one_field() -> None:
    """A key is a ConnectorConfig field; one named like a setting of serve's (or of the
    service's) is that setting, with its default, or a declared override."""
    serve = _fields((*SERVE_CONFIGS, ServiceConfig))
    keys = {f.name for f in dataclasses.fields(ConnectorConfig)}
    for key in keys:
        if key not in serve:
            assert key not in SERVE_SETTINGS  # the connector's own
            continue
        assert key in SERVE_SETTINGS, f"{key} is serve's setting: take its default"
        owner = SERVE_SETTINGS[key]
        assert owner in serve[key], f"{key} is no field of {owner.__name__}"
        ours, theirs = _default(ConnectorConfig, key), _default(owner, key)
        if key in VLLM_OVERRIDES:
            assert ours == VLLM_OVERRIDES[key].value != theirs and VLLM_OVERRIDES[key].why
        else:
            assert ours == theirs, f"{key}: {ours!r}, serve's {theirs!r}"
    assert set(SERVE_SETTINGS) <= keys and set(VLLM_OVERRIDES) <= set(SERVE_SETTINGS)
    assert not set(OLD_KEYS) & keys and set(OLD_KEYS.values()) <= keys


def test_the_connector_defaults_are_serves() -> None:
    """min_load_tokens was 0 here and 32 in serve, silently: now a named override."""
    config = ConnectorConfig()
    assert config.disk_cache_gb == CacheConfig().disk_cache_gb
    assert config.kv_events_pool == LaunchConfig.kv_events_pool
    assert config.min_load_tokens == VLLM_OVERRIDES["min_load_tokens"].value
    assert config.min_load_tokens != EngineConfig().min_load_tokens


def test_the_renamed_and_overridden_names_are_documented() -> None:
    operations = (DOCS / "operations.md").read_text()
    for old, new in DEPRECATED_FLAGS.items():
        assert f"`{old}`" in operations and f"`{new}`" in operations, old
    vllm = (DOCS / "vllm.md").read_text()
    for key in (*OLD_KEYS, *VLLM_OVERRIDES):
        assert f"`{key}`" in vllm, key
