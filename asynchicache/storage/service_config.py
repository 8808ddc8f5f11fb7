"""The cache service's configuration and where it listens.

The service trusts whoever connects (it maps their segments, writes their
pages): it listens on an `ipc://` file in a private (0700) runtime folder, or
on loopback TCP, nowhere else.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from asynchicache.config import GIB, CacheConfig, ServiceTuning
from asynchicache.storage.disk_config import DiskConfig
from asynchicache.storage.disk_write import SyncMode
from asynchicache.storage.fileio import make_private_dir
from asynchicache.storage.messages import ServiceSettings
from asynchicache.storage.tiered import RemoteTierConfig


def default_runtime_dir() -> Path:
    """A per-user private folder for sockets: $XDG_RUNTIME_DIR or the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"asynchicache-{os.getuid()}"


def default_address() -> str:
    return f"ipc://{default_runtime_dir() / 'cache.sock'}"


def prepare_address(address: str) -> None:
    """Create the private (0700) folder of an `ipc://` address, refusing a foreign one."""
    if not address.startswith("ipc://"):
        return
    folder = Path(address[len("ipc://") :]).parent
    make_private_dir(folder)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"socket folder {folder} must be private to this user")


@dataclass(frozen=True)
class ServiceConfig:
    """The cache service: where pages live, where it listens, how hard it works."""

    disk_cache_dir: Path
    address: str = field(default_factory=default_address)
    capacity_bytes: int = int(CacheConfig.disk_cache_gb * GIB)  # the whole folder's
    io_threads: int = ServiceTuning.io_threads
    workers: int = ServiceTuning.workers
    sync: SyncMode = SyncMode(ServiceTuning.disk_sync)  # noqa: RUF009 (an immutable enum member)
    direct_io: bool = True
    client_ttl_s: float = ServiceTuning.client_ttl_s  # a client silent this long is dropped
    remote: RemoteTierConfig | None = None  # L4 (Redis/Valkey) behind the disk: --remote-url
    max_pinned_fraction: float = DiskConfig.max_pinned_fraction  # of capacity_bytes
    # Started for vLLM instances (integrations.vllm.service_process): run while a lease is
    # held (storage.service_leases), and this pid holds the first one until it takes its own.
    leased_by: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "disk_cache_dir", Path(self.disk_cache_dir))
        if self.capacity_bytes <= 0:
            raise ValueError(f"--disk-cache-gb must be positive, got {self.capacity_bytes} bytes")
        if self.workers <= 0 or self.io_threads <= 0:
            raise ValueError("--workers and --io-threads must be positive")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(
                f"--max-pinned-fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        if "://" not in self.address:
            raise ValueError(
                f"--socket must be a ZeroMQ address like ipc://PATH, got {self.address}"
            )
        _check_local(self.address)
        if self.leased_by is not None and self.leased_by <= 0:
            raise ValueError(f"--leased-by must be a pid, got {self.leased_by}")

    @property
    def settings(self) -> ServiceSettings:
        """What a lease compares (the same function on both sides: the connector builds the
        ServiceConfig of the service it would start, and asks for its settings)."""
        remote = self.remote
        return ServiceSettings(
            os.path.realpath(self.disk_cache_dir),
            self.capacity_bytes,
            remote.url if remote else None,
            remote.ttl_s if remote else None,
            remote.admit_hits if remote else 0,
            remote.admit_tokens if remote else 0,
        )


def _check_local(address: str) -> None:
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        return
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a host name: not provably local
        loopback = False
    if scheme != "tcp" or not loopback:
        raise ValueError(
            f"--socket must be ipc://PATH or tcp://127.0.0.1:PORT (the service has no "
            f"authentication), got {address}"
        )
