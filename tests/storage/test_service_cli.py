"""The cache service's command line: `ServiceConfig`'s defaults; errors name their flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynchicache.storage.service.service_cli import config_from_args as _parse
from asynchicache.storage.service.service_config import ServiceConfig


def test_no_flag_given_is_the_dataclass_default(tmp_path: Path) -> None:
    assert _parse(["--disk-cache-dir", str(tmp_path)]) == ServiceConfig(tmp_path)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--io-threads", "0"], "--io-threads"),
        (["--workers", "0"], "--workers"),
        (["--disk-cache-gb", "0"], "--disk-cache-gb"),
        (["--max-pinned-fraction", "2"], "--max-pinned-fraction"),
        (["--address", "tcp://10.1.2.3:5555"], "--address"),
    ],
)
def test_a_bad_value_names_its_flag(tmp_path: Path, argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _parse(["--disk-cache-dir", str(tmp_path), *argv])


def test_leased_by_is_a_pid(tmp_path: Path) -> None:
    assert _parse(["--disk-cache-dir", str(tmp_path), "--leased-by", "42"]).leased_by == 42
    with pytest.raises(ValueError, match="--leased-by"):
        _parse(["--disk-cache-dir", str(tmp_path), "--leased-by", "0"])
