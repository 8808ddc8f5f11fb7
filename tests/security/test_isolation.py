"""Isolation without a server: private files and folders, namespaces that never mix,
and a cache service that listens only where no one else can reach it."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from curve_certs import curve_certs

from asynchicache.common.keys import Namespace, page_hashes
from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.service.server import CacheService, ServiceConfig, prepare_address

LAYOUT = PageLayout("float32", (2, 2, 4, 2, 8))
TOKENS = tuple(range(4))
BASE = Namespace("model-a", "float32", 4)


def _backend(root: Path, ns: Namespace, layout: PageLayout = LAYOUT) -> DiskBackend:
    return DiskBackend(DiskConfig(root, ns.encode(), layout, 10**8, io_threads=2))


def _pool(slots: int, layout: PageLayout = LAYOUT, fill: int = 7) -> np.ndarray:
    return np.full((slots, layout.page_bytes), fill, dtype=np.uint8)


@pytest.fixture
def backends() -> Iterator[list[DiskBackend]]:
    opened: list[DiskBackend] = []
    yield opened
    for b in opened:
        b.close()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_0600_and_folders_0700_whatever_the_umask(
    tmp_path: Path, backends: list[DiskBackend]
) -> None:
    old = os.umask(0)  # the most permissive umask a user could have
    try:
        disk = _backend(tmp_path / "kv", BASE)
        backends.append(disk)
        (h,) = page_hashes(BASE, TOKENS)
        assert disk.put([PageRef(h, TOKENS, 0)], _pool(1)) == 1
    finally:
        os.umask(old)
    path = disk.path_of(h)
    assert _mode(path) == 0o600
    for folder in (path.parent, path.parent.parent, tmp_path / "kv"):
        assert _mode(folder) == 0o700, folder


@pytest.mark.parametrize(
    "other",
    [
        Namespace("model-b", "float32", 4),  # another model
        Namespace("model-a", "bfloat16", 4),  # another dtype
        Namespace("model-a", "float32", 8),  # another page size
        Namespace("model-a", "float32", 4, layout_version=1),  # another KV layout
        BASE.with_salt("tenant-b"),  # another tenant
        Namespace("model-a", "float32", 4, engine="vllm"),  # another engine
        Namespace("model-a", "float32", 4, numerics_version=0),  # older numerics
    ],
    ids=["model", "dtype", "page-size", "layout", "salt", "engine", "numerics"],
)
def test_a_page_of_another_namespace_is_never_served(
    tmp_path: Path, backends: list[DiskBackend], other: Namespace
) -> None:
    mine = _backend(tmp_path, BASE)
    theirs = _backend(tmp_path, other)  # the same folder: what a shared cache dir looks like
    backends += [mine, theirs]
    (h,) = page_hashes(BASE, TOKENS)
    assert page_hashes(other, TOKENS) != [h]  # the names differ already...
    assert mine.put([PageRef(h, TOKENS, 0)], _pool(1)) == 1
    dst = _pool(1, fill=0)
    assert theirs.exists([h]) == 0 and theirs.get([h], [0], dst) == 0
    # ...and a file planted under the other namespace's name for it is refused, whether
    # the reader finds it at start-up (header scan) or is asked for it straight away.
    planted = theirs.path_of(h)
    planted.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(mine.path_of(h), planted)
    restarted = _backend(tmp_path, other)
    backends.append(restarted)
    assert restarted.wait_ready(10)
    assert restarted.get([h], [0], dst) == 0
    assert restarted.stats().corrupt_detected == 1 and not planted.exists()
    shutil.copyfile(mine.path_of(h), planted)
    assert theirs.get([h], [0], dst) == 0, "not indexed: not even read"
    assert not dst.any(), "bytes of another namespace reached the pool"


def test_a_page_of_another_layout_is_refused(tmp_path: Path, backends: list[DiskBackend]) -> None:
    """Same namespace bytes, different page layout (a mis-configured service): a miss."""
    mine = _backend(tmp_path, BASE)
    other_layout = PageLayout("float32", (2, 2, 4, 2, 4))
    theirs = _backend(tmp_path, BASE, other_layout)
    backends += [mine, theirs]
    (h,) = page_hashes(BASE, TOKENS)
    assert mine.put([PageRef(h, TOKENS, 0)], _pool(1)) == 1
    dst = _pool(1, other_layout, fill=0)
    assert theirs.get([h], [0], dst) == 0 and not dst.any()


def test_namespace_fields_all_change_the_page_names() -> None:
    variants = [
        BASE,
        Namespace("model-b", "float32", 4),
        Namespace("model-a", "float16", 4),
        Namespace("model-a", "float32", 4, 1),
        Namespace("model-a", "float32", 4, engine="vllm"),
        Namespace("model-a", "float32", 4, numerics_version=0),
        BASE.with_salt("a"),
        BASE.with_salt("b"),
    ]
    digests = {ns.digest() for ns in variants}
    assert len(digests) == len(variants)
    # A salt is not a string that could collide with another field's encoding.
    assert BASE.with_salt("x").encode() != Namespace("model-a", "float32", 4).encode()


def test_service_socket_folder_is_private(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    prepare_address(f"ipc://{folder}/cache.sock")
    assert _mode(folder) == 0o700 and folder.stat().st_uid == os.getuid()
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    if os.getuid() == 0:  # root can hand the folder to someone else
        os.chown(foreign, 65534, 65534)
        with pytest.raises(PermissionError):
            prepare_address(f"ipc://{foreign}/cache.sock")


@pytest.mark.parametrize(
    "address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555"]
)
def test_service_refuses_to_listen_beyond_this_machine(tmp_path: Path, address: str) -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        ServiceConfig(tmp_path / "kv", address)


def _listening(port: int) -> list[str]:
    """Local addresses listening on `port` (from /proc/net/tcp)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        ip_hex, port_hex = cols[1].split(":")
        if cols[3] == "0A" and int(port_hex, 16) == port:
            out.append(".".join(str(int(ip_hex[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_service_on_loopback_tcp_when_asked(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()
    keys, _, _ = curve_certs(tmp_path)  # tcp:// needs CURVE (test_service_socket.py)
    cfg = ServiceConfig(tmp_path / "kv", f"tcp://127.0.0.1:{port}", curve=keys)
    service = CacheService(cfg, stop)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        assert _listening(port) == ["127.0.0.1"]
    finally:
        stop.set()
        thread.join(10)
