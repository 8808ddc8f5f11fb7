"""Issue 22, finding 7: no value of a flag or of a `--config` YAML key starts a broken server.

Every numeric flag refuses nan, inf and values of the wrong type with the flag's name
(on the command line and in YAML); a string flag given a YAML number (`api-key: 12345`)
is refused naming the key; a YAML key given twice is refused. Each value is checked the
way `asynchicache serve` checks it (parse, then build the configs), in this process: a
value that slipped through would otherwise start a server.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest
from serve_refusal import serve_refusal

from asynchicache.launch.options import build_parser, parse_args, to_config
from asynchicache.settings.config import CacheConfig, EngineConfig, LaunchConfig, ServerConfig


def _numeric_flags() -> list[tuple[str, bool]]:
    """(flag, takes an integer) for every flag of `serve` that parses a number."""
    out = []
    for action in build_parser()._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        kind = getattr(action.type, "__name__", "")
        if kind in ("int", "float", "finite_float"):
            out.append((action.option_strings[0], kind == "int"))
    return out


NUMERIC = _numeric_flags()


def test_the_numeric_flags_are_found() -> None:
    names = {flag for flag, _ in NUMERIC}
    assert {"--host-cache-gb", "--disk-cache-gb", "--port", "--storage-timeout",
            "--prefetch-timeout", "--max-pinned-fraction", "--client-ttl"} <= names  # fmt: skip


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "NaN"])
@pytest.mark.parametrize(("flag", "integer"), NUMERIC)
def test_numeric_flags_refuse_nan_and_inf(flag: str, integer: bool, value: str) -> None:
    message = serve_refusal(flag, value)
    assert message is not None, f"{flag} {value} was accepted"
    assert flag in message


@pytest.mark.parametrize(("flag", "integer"), [f for f in NUMERIC if f[1]])
def test_integer_flags_refuse_fractions(flag: str, integer: bool) -> None:
    message = serve_refusal(flag, "1.5")
    assert message is not None and flag in message


def _yaml(tmp_path: Path, text: str) -> str | None:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return serve_refusal("--config", str(path))


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e999", "true", "[1]", "'nan'"])
@pytest.mark.parametrize(("flag", "integer"), NUMERIC)
def test_yaml_numbers_are_checked_like_flags(
    tmp_path: Path, flag: str, integer: bool, value: str
) -> None:
    key = flag.lstrip("-")
    message = _yaml(tmp_path, f"{key}: {value}\n")
    assert message is not None, f"{key}: {value} was accepted"
    assert key in message


@pytest.mark.parametrize("flag", [f for f, integer in NUMERIC if integer])
def test_yaml_integer_flags_refuse_fractions(tmp_path: Path, flag: str) -> None:
    """int(80.5) is 80: a fraction must not be cut silently."""
    key = flag.lstrip("-")
    message = _yaml(tmp_path, f"{key}: 80.5\n")
    assert message is not None and key in message


@pytest.mark.parametrize("key", ["api-key", "admin-api-key", "host", "model", "remote-url"])
@pytest.mark.parametrize("value", ["12345", "012345", "1.5", "true"])
def test_yaml_string_flags_refuse_numbers(tmp_path: Path, key: str, value: str) -> None:
    """`api-key: 12345` once started a server that answered 500 on every route."""
    message = _yaml(tmp_path, f"{key}: {value}\n")
    assert message is not None, f"{key}: {value} was accepted"
    assert key in message and "quote" in message


def test_yaml_quoted_values_and_numbers_still_work(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text('api-key: "12345"\nport: 9100\nhost-cache-gb: 1\ndisk-cache-gb: 2.5\n'
                    f"disk-cache-dir: {tmp_path / 'kv'}\n")  # fmt: skip
    cfg = to_config(parse_args(["--device", "cpu", "--config", str(path)]))
    assert cfg.server.api_key == "12345" and cfg.server.port == 9100
    assert (cfg.cache.host_cache_gb, cfg.cache.disk_cache_gb) == (1.0, 2.5)


@pytest.mark.parametrize(
    "text", ["port: 9100\nport: 9200\n", "api-key: a\napi_key: b\n", "port: 1\n--port: 2\n"]
)
def test_yaml_keys_given_twice_are_refused(tmp_path: Path, text: str) -> None:
    message = _yaml(tmp_path, text)
    assert message is not None and "more than once" in message


def _launch_with_fractional_tokens() -> LaunchConfig:
    cache = CacheConfig(disk_cache_dir=None)
    return LaunchConfig(ServerConfig(), EngineConfig(), cache, host_cache_tokens=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda: CacheConfig(host_cache_gb=float("nan")), "--host-cache-gb"),
        (lambda: CacheConfig(disk_cache_gb=float("inf")), "--disk-cache-gb"),
        (lambda: CacheConfig(page_size=16.0), "--page-size"),  # type: ignore[arg-type]
        (lambda: CacheConfig(max_pinned_fraction=float("nan")), "--max-pinned-fraction"),
        (lambda: EngineConfig(max_running_requests=True), "--max-running-requests"),
        (lambda: ServerConfig(port="8000"), "--port"),  # type: ignore[arg-type]
        (lambda: ServerConfig(api_key=12345), "--api-key"),  # type: ignore[arg-type]
        (lambda: ServerConfig(shutdown_timeout_s=float("inf")), "--shutdown-timeout"),
        (_launch_with_fractional_tokens, "--hiradix_cache_token_num"),
    ],
)
def test_configs_built_in_code_check_too(make: object, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        make()  # type: ignore[operator]


def test_argparse_errors_name_the_flag() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        from asynchicache.settings.config_flags import finite_float

        finite_float("nan")


@pytest.mark.parametrize(
    "argv",
    [["cache", "verify", "--deep", "--tolerance", "nan"],
     ["cache", "verify", "--deep", "--tolerance", "inf"]],
)  # fmt: skip
def test_the_cache_command_refuses_nan_too(argv: list[str]) -> None:
    from asynchicache.cli import build_parser as cli_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        cli_parser().parse_known_args(argv)
    assert "--tolerance" in err.getvalue()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_cache_service_refuses_nan_too(value: str) -> None:
    from asynchicache.storage.service.service_cli import config_from_args

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        config_from_args(["--disk-cache-dir", "/nonexistent", "--disk-cache-gb", value])
    assert "--disk-cache-gb" in err.getvalue()
