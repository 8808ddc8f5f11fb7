"""Issue 39, finding 8: the cache service's socket.

On a loopback `tcp://` address the service had no authentication: any local user could
Load any tenant's pages, Store pages under any name, or Clear. Now `tcp://` needs ZeroMQ
CURVE (the KV event sockets' code, common/curve.py): refused without keys; with them,
only the listed clients' keys get an answer. `ipc://` in a private folder stays the
default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from curve_certs import curve_certs
from ports import free_port

from asynchicache.common.curve import ClientCurve
from asynchicache.storage.client.storage_client import ClientConfig, StorageClient
from asynchicache.storage.service.server import CacheService, ServiceConfig
from asynchicache.storage.service.service_cli import config_from_args


def test_plain_loopback_tcp_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CURVE"):
        ServiceConfig(tmp_path / "kv", f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="--curve-secret-key"):
        config_from_args(["--disk-cache-dir", str(tmp_path), "--socket", "tcp://127.0.0.1:5555"])
    keys, _, _ = curve_certs(tmp_path)
    cfg = config_from_args(["--disk-cache-dir", str(tmp_path), "--socket", "tcp://127.0.0.1:5555",
                            "--curve-secret-key", str(keys.secret_key_file),
                            "--curve-clients", str(keys.clients_dir)])  # fmt: skip
    assert cfg.curve is not None and cfg.curve.clients_dir == keys.clients_dir
    assert ServiceConfig(tmp_path / "kv").address.startswith("ipc://")  # the default


@pytest.fixture
def curve_service(tmp_path: Path) -> Iterator[tuple[str, Path, Path, Path]]:
    """A service on loopback tcp:// with CURVE: (address, its public key file, a listed
    client's certificate, a stranger's)."""
    keys, client, stranger = curve_certs(tmp_path)
    address = f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    service = CacheService(ServiceConfig(tmp_path / "kv", address, curve=keys), stop)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        yield address, keys.secret_key_file.with_suffix(".key"), client, stranger
    finally:
        stop.set()
        thread.join(10)


def _answers(address: str, curve: ClientCurve | None) -> bool:
    """Whether a Stats request gets an answer within 3 s (connected or not)."""
    client = StorageClient(ClientConfig(address, curve=curve))
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if client.stats(timeout_s=0.2) is not None:
                return True
            client.poll()
            time.sleep(0.05)
        return False
    finally:
        client.close()


def test_only_listed_clients_reach_a_tcp_service(
    curve_service: tuple[str, Path, Path, Path],
) -> None:
    address, server_public, client, stranger = curve_service
    assert _answers(address, ClientCurve(server_public, client))
    assert not _answers(address, None)  # a local user without keys
    assert not _answers(address, ClientCurve(server_public, stranger))  # keys not listed
