"""The service the vLLM connector starts, and the lease it asks for, are one config:
`service_config` builds it (as `serve` and the service's command line build theirs),
the child's flags parse back into an equal config, and the lease's settings are that
config's, exactly as the older route through the flags gave them."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_process import (
    service_args,
    service_config,
    service_settings,
)
from asynchicache.storage.service.service_cli import config_from_args

REMOTE = "redis://127.0.0.1:6379/0"  # parsed, never connected to


def _configs(tmp_path: Path) -> list[ConnectorConfig]:
    key = tmp_path / "keys"
    key.write_text("secret\n")
    key.chmod(0o600)
    address = f"ipc://{tmp_path / 'run' / 'c.sock'}"
    return [
        ConnectorConfig(disk_cache_dir=tmp_path / "kv"),  # defaults: the address from the folder
        ConnectorConfig(
            disk_cache_dir=tmp_path / "kv",
            disk_cache_gb=0.3,
            remote_url=REMOTE,
            remote_ttl_s=60,
            cache_service=address,
            direct_io=True,
        ),
        ConnectorConfig(
            disk_cache_dir=tmp_path / "kv",
            cache_key_file=key,
            cache_encrypt=True,
            cache_service=address,
        ),
    ]


@pytest.mark.parametrize("case", [0, 1, 2])
def test_the_service_started_is_the_one_the_lease_names(tmp_path: Path, case: int) -> None:
    config = _configs(tmp_path)[case]
    launched = config_from_args(service_args(config))  # what the child runs with
    assert launched == service_config(config)
    assert service_settings(config) == launched.settings  # the lease asks for what runs
