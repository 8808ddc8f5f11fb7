"""One cache-service configuration, three ways in: `serve`, the service's own command line
and the vLLM connector's launcher build equal `ServiceConfig`s for the same settings."""

from __future__ import annotations

from pathlib import Path

from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_process import service_args
from asynchicache.launch.launch import _service_spec
from asynchicache.launch.options import parse_args, to_config
from asynchicache.storage.service.service_cli import config_from_args
from asynchicache.storage.service.service_config import CACHE_FLAGS, TUNING_FLAGS, ServiceConfig

REMOTE = "redis://127.0.0.1:6379/0"  # parsed, never connected to


def _serve(tmp_path: Path, flags: list[str]) -> ServiceConfig:
    """What `serve` would start its cache service with, for these flags."""
    launch = to_config(parse_args(["--disk-cache-dir", str(tmp_path / "kv"), *flags]), {})
    spec = _service_spec(launch.cache, launch.service, tmp_path, "INFO", 10.0)
    assert spec is not None
    return spec.arg.config


def _service_cli(tmp_path: Path, flags: list[str], address: str) -> ServiceConfig:
    argv = ["--disk-cache-dir", str(tmp_path / "kv"), "--address", address, *flags]
    return config_from_args(argv)


def test_serve_and_the_service_command_line_agree_on_every_service_flag(tmp_path: Path) -> None:
    flags = [
        "--disk-cache-gb", "3.5", "--max-pinned-fraction", "0.25",
        "--disk-admit-hits", "2", "--disk-admit-tokens", "100",
        "--remote-url", REMOTE, "--remote-ttl-s", "60",
        "--disk-sync", "file", "--io-threads", "3", "--workers", "2", "--client-ttl-s", "30.5",
    ]  # fmt: skip
    assert {f for f in flags if f.startswith("--")} >= {*CACHE_FLAGS, *TUNING_FLAGS}
    served = _serve(tmp_path, flags)
    assert served == _service_cli(tmp_path, flags, served.address)
    assert served.remote is not None and served.remote.disk_admit_hits == 2
    assert served.disk_cache_bytes == int(3.5 * 2**30) and served.disk_sync == "file"


def test_the_old_flag_names_still_start_the_same_service(tmp_path: Path) -> None:
    """--remote-ttl, --client-ttl and the service's --socket: deprecated aliases (issue 43)."""
    new = ["--remote-url", REMOTE, "--remote-ttl-s", "60", "--client-ttl-s", "30.5"]
    old = ["--remote-url", REMOTE, "--remote-ttl", "60", "--client-ttl", "30.5"]
    served = _serve(tmp_path, new)
    assert _serve(tmp_path, old) == served
    argv = ["--disk-cache-dir", str(tmp_path / "kv"), "--socket", served.address, *old]
    assert config_from_args(argv) == served


def test_the_vllm_launcher_starts_the_service_serve_would(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path / 'cache-service'}"
    connector = ConnectorConfig(
        disk_cache_dir=tmp_path / "kv",
        disk_cache_gb=3.5,
        remote_url=REMOTE,
        remote_ttl_s=60,
        cache_service=address,
        direct_io=True,
    )
    launched = config_from_args(service_args(connector))
    served = _serve(tmp_path, ["--disk-cache-gb", "3.5", "--remote-url", REMOTE,
                               "--remote-ttl-s", "60"])  # fmt: skip
    assert launched == served
