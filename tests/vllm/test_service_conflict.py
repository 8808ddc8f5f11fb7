"""A vLLM instance whose connector settings conflict with the running cache service's
fails at start (the connector's scheduler side raises, naming the setting) and leaves
nothing behind: no L2 segment, no lease; the service keeps serving the other one."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from asynchicache.common.shm import list_segments, owner_pid
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_link import ServiceConflict
from asynchicache.integrations.vllm.l2.service_process import service_pid, wait_service_gone
from asynchicache.integrations.vllm.namespace import ModelIdentity
from asynchicache.integrations.vllm.scheduler_side import SchedulerSide
from asynchicache.integrations.vllm.spec import VllmKVSpec


def _spec() -> VllmKVSpec:
    identity = ModelIdentity("tiny-test", "0" * 40, "test", "cpu", "CPU_ATTN:vec", "float32", 32)
    return VllmKVSpec(32, 64, ("l0", "l1"), 2, 8, torch.float32, identity)


def test_a_conflicting_instance_fails_at_start_and_leaves_nothing(tmp_path: Path) -> None:
    config = ConnectorConfig(
        disk_cache_dir=tmp_path / "kv",
        cache_service=f"ipc://{tmp_path}/run/c.sock",
        host_cache_gb=100_000 / 2**30,
        disk_cache_gb=1.0,
    )
    first = SchedulerSide(_spec(), config)
    try:
        with pytest.raises(ServiceConflict, match=r"disk_cache_gb \(this instance: 2 GiB"):
            SchedulerSide(_spec(), dataclasses.replace(config, disk_cache_gb=2.0))
        ours = [s for s in list_segments() if owner_pid(s) == os.getpid()]
        assert ours == [first.pool.name]  # the refused one's L2 segment went with it
        assert first.link.connected  # the service still serves the first instance
    finally:
        first.shutdown()
    assert wait_service_gone(config.service_address, 30)
    assert service_pid(config.service_address) is not None  # it did run, and exited
