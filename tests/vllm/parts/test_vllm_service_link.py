"""The vLLM connector's line to its cache service (`ServiceLink`) and the service it
starts, as real processes: one service serves every instance that uses it and
outlives the one that started it; an instance whose settings differ from the
running service's fails at start, naming the setting; a service whose last
instance was SIGKILLed exits and removes that instance's L2 segment.

Each link stands for one vLLM engine core (it leases the service for its
process); two links in this process hold two leases.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from processes import pid_alive

from asynchicache.common.keys import Namespace, chain_hashes
from asynchicache.common.shm import SHM_DIR
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2 import service_link as link_module
from asynchicache.integrations.vllm.l2.service_link import ServiceConflict, ServiceLink
from asynchicache.integrations.vllm.l2.service_process import service_pid, wait_service_gone
from asynchicache.storage.base import Completion, PageLayout, PageRef, TicketKind

LAYOUT = KVLayout(2, 2, 8, 16, torch.float32)
PAGE = PageLayout("float32", LAYOUT.page_shape)
NAMESPACE = b"link-test\x1ffloat32"

Links = Callable[[ConnectorConfig], ServiceLink]


@pytest.fixture
def config(tmp_path: Path) -> ConnectorConfig:
    return ConnectorConfig(
        disk_cache_dir=tmp_path / "kv",
        cache_service=f"ipc://{tmp_path}/run/c.sock",
        disk_cache_gb=1.0,
        service_start_timeout_s=60.0,
    )


@pytest.fixture
def links() -> Iterator[Links]:
    """`links(config)`: a link with an L2 pool of its own; closed after the test, and then
    the services they used must have exited."""
    made: list[tuple[ServiceLink, HostPool]] = []

    def make(config: ConnectorConfig) -> ServiceLink:
        pool = HostPool.create(LAYOUT, 8, tag="vllm")
        made.append((ServiceLink(config, NAMESPACE, pool.name, PAGE), pool))
        return made[-1][0]

    yield make
    for link, pool in made:
        link.close()
        pool.close()
    for address in {link.config.service_address for link, _ in made}:
        assert wait_service_gone(address, 30), f"the service at {address} outlived its users"


def test_the_service_outlives_the_instance_that_started_it(
    config: ConnectorConfig, links: Links
) -> None:
    first = links(config)
    assert first.wait_connected(60)
    pid = service_pid(config.service_address)
    second = links(config)
    assert second.wait_connected(20)
    first.close()  # the starter stops: its lease is released
    assert second.connected and service_pid(config.service_address) == pid
    assert pid is not None and pid_alive(pid)
    second.ask_exists(1, [b"h" * 16])  # the service still answers the other instance
    second.wait_events(5.0)
    assert [e.pages for e in second.events()] == [0]
    second.close()  # the last instance: the service exits
    assert wait_service_gone(config.service_address, 30)


@pytest.mark.parametrize(
    ("change", "key", "values"),
    [
        ({"disk_cache_gb": 2.0}, "disk_cache_gb", ("2 GiB", "1 GiB")),
        ({"remote_url": "redis://127.0.0.1:1/0"}, "remote_url", ("redis://127.0.0.1:1/0", None)),
    ],
)
def test_an_instance_with_other_settings_fails_at_start_naming_the_setting(
    config: ConnectorConfig,
    links: Links,
    change: dict,
    key: str,
    values: tuple,
) -> None:
    assert links(config).wait_connected(60)
    other = links(dataclasses.replace(config, **change))
    with pytest.raises(ServiceConflict) as err:
        other.wait_connected(20)
    wanted, running = values
    assert f"{key} (this instance: {wanted}, the service: {running})" in str(err.value)
    assert not other.connected


def test_another_disk_folder_at_the_same_address_is_refused(
    config: ConnectorConfig, links: Links, tmp_path: Path
) -> None:
    assert links(config).wait_connected(60)
    other = links(dataclasses.replace(config, disk_cache_dir=tmp_path / "elsewhere"))
    with pytest.raises(ServiceConflict, match="disk_cache_dir"):
        other.wait_connected(20)


_LINK_PROCESS = """
import sys, time, torch
from pathlib import Path
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.l2.service_link import ServiceLink
from asynchicache.storage.base import PageLayout
layout = KVLayout(2, 2, 8, 16, torch.float32)
pool = HostPool.create(layout, 8, tag="vllm")
config = ConnectorConfig(disk_cache_dir=Path(sys.argv[1]), cache_service=sys.argv[2],
                         disk_cache_gb=1.0)
link = ServiceLink(config, b"link-test", pool.name, PageLayout("float32", layout.page_shape))
assert link.wait_connected(60)
print(pool.name, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_last_instance_ends_the_service_and_its_segment_goes(
    config: ConnectorConfig,
) -> None:
    argv = [sys.executable, "-c", _LINK_PROCESS, str(config.disk_cache_dir)]
    proc = subprocess.Popen([*argv, config.service_address], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        segment = proc.stdout.readline().decode().strip()
        assert segment and (SHM_DIR / segment).exists()
        pid = service_pid(config.service_address)
        assert pid is not None and pid_alive(pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # as vLLM stops its engine core
        proc.wait(10)
    assert wait_service_gone(config.service_address, 30)
    assert not (SHM_DIR / segment).exists()


def test_an_instance_that_starts_no_service_takes_the_running_one_as_it_is(
    config: ConnectorConfig, links: Links
) -> None:
    assert links(config).wait_connected(60)
    other = dataclasses.replace(config, disk_cache_gb=5.0, start_service=False)
    assert links(other).wait_connected(20)  # leased, whatever its own disk_cache_gb says


def _stored(link: ServiceLink, timeout_s: float) -> list[object]:
    """The store completions the link reports within `timeout_s`."""
    got: list[object] = []
    deadline = time.monotonic() + timeout_s
    while not got and time.monotonic() < deadline:
        link.wait_events(0.05)
        got += [
            e for e in link.events() if isinstance(e, Completion) and e.kind is TicketKind.STORE
        ]
    return got


def test_stores_wait_while_a_step_computes_and_go_when_it_ended(
    links: Links, config: ConnectorConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store sent during a compute-bound step waits for the step's end (the service's
    CPU would take the compute threads' cores), and never longer than the hold's bound."""
    link = links(config)
    assert link.wait_connected(60)
    root = Namespace("m", "float32", 16).digest()
    hashes = chain_hashes(root, list(range(32)), 16)
    refs = [PageRef(hashes[0], tuple(range(16)), 0, root)]
    link.hold_stores(time.monotonic() + 60)
    link.store(1, refs)
    assert _stored(link, 0.5) == []  # held
    link.hold_stores(0.0)  # the step ended
    assert len(_stored(link, 30)) == 1
    monkeypatch.setattr(link_module, "_HOLD_MAX_S", 0.3)
    link.hold_stores(time.monotonic() + 60)
    link.store(2, [PageRef(hashes[1], tuple(range(16, 32)), 1, hashes[0])])
    assert len(_stored(link, 30)) == 1  # held no longer than _HOLD_MAX_S
