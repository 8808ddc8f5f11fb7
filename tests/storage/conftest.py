"""Fixtures for the storage tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from service_process import ServiceProcess
from storage_clients import Clients, client_factory


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short private folder for ipc:// sockets (socket paths are limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="acs-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def services() -> Iterator[Callable[..., ServiceProcess]]:
    """Start real service processes; every one is stopped (or killed) after the test."""
    started: list[ServiceProcess] = []

    def start(disk_dir: Path, address: str, *extra: str) -> ServiceProcess:
        started.append(ServiceProcess(disk_dir, address, *extra).start())
        return started[-1]

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture
def clients() -> Iterator[Clients]:
    """`clients(address, pool, ready_s=None, **config)`: storage clients, closed after the test."""
    yield from client_factory()
