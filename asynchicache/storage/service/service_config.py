"""The cache service's configuration, its flags, and where it listens.

One flag table (`CACHE_FLAGS`, `TUNING_FLAGS`, plus `add_service_flags`' remote
flags) serves `asynchicache serve` (launch/flags.py), `asynchicache service`
(storage/service/service_cli.py) and the vLLM connector's launcher, which writes the
service's argv from the same table (`service_argv`); `ServiceConfig.from_flags` /
`from_configs` read it back, so the three cannot drift. Each flag is the name of the
field it sets (CacheConfig's, ServiceTuning's or ServiceConfig's: `--disk-sync` sets
`disk_sync` in all three places), its default written once, in settings/config.py.

The service trusts whoever connects (it maps their segments, writes their
pages): it listens on an `ipc://` file in a private (0700) runtime folder, or
on loopback TCP with ZeroMQ CURVE (`--curve-secret-key`, `--curve-clients`:
only the listed clients' keys get in; any local user could connect to a plain
loopback port), nowhere else.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asynchicache.common.curve import CurveKeys
from asynchicache.common.fileio import make_private_dir, private_dir_problem
from asynchicache.settings.config import (
    GIB,
    CacheConfig,
    ServiceTuning,
    SyncMode,
    check_cache_encrypt,
    check_disk_cache_bytes,
    check_max_pinned_fraction,
)
from asynchicache.settings.config_flags import add_config_flags, config_argv, config_kwargs
from asynchicache.storage.messages import ServiceSettings
from asynchicache.storage.service.tiered import RemoteTierConfig


def default_runtime_dir() -> Path:
    """A per-user private folder for sockets: $XDG_RUNTIME_DIR or the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"asynchicache-{os.getuid()}"


def default_address() -> str:
    return f"ipc://{default_runtime_dir() / 'cache.sock'}"


def prepare_address(address: str) -> None:
    """Create the private (0700) folder of an `ipc://` address, refusing a foreign one."""
    if address.startswith("ipc://"):
        prepare_runtime_dir(Path(address[len("ipc://") :]).parent)


def prepare_runtime_dir(folder: Path) -> None:
    """Make `folder` (0700) when missing; refuse it unless it is a real folder of this
    user's that no one else may enter, as mkdtemp's would be. Its default path is
    predictable: another local user may have made it first, or planted a symlink there
    (which passes every check made through it, then points elsewhere)."""
    if not os.path.lexists(folder):
        make_private_dir(folder)
    why = private_dir_problem(folder)
    if why is not None:
        raise PermissionError(
            f"the socket folder {folder} {why}: whoever controls it could read or serve this "
            "cache's pages. Remove it, or set XDG_RUNTIME_DIR (or --address) to a folder "
            "of your own"
        )


@dataclass(frozen=True)
class ServiceConfig:
    """The cache service: where pages live, where it listens, how hard it works."""

    disk_cache_dir: Path
    address: str = field(default_factory=default_address)  # --address (was --socket)
    disk_cache_bytes: int = int(CacheConfig.disk_cache_gb * GIB)  # the whole folder's
    io_threads: int = ServiceTuning.io_threads
    workers: int = ServiceTuning.workers
    disk_sync: SyncMode = ServiceTuning.disk_sync
    direct_io: bool = True  # --no-direct-io turns it off
    client_ttl_s: float = ServiceTuning.client_ttl_s  # a client silent this long is dropped
    remote: RemoteTierConfig | None = None  # L4 (Redis/Valkey) behind the disk: --remote-url
    max_pinned_fraction: float = CacheConfig.max_pinned_fraction  # of disk_cache_bytes
    # Started for vLLM instances (integrations.vllm.service_process): run while a lease is
    # held (storage.service.leases), and this pid holds the first one until it takes its own.
    leased_by: int | None = None
    cache_key_file: Path | None = None  # pages carry a keyed MAC (page_keys.py)
    cache_encrypt: bool = False  # pages are AES-GCM encrypted (page_cipher.py)
    curve: CurveKeys | None = None  # --curve-secret-key / --curve-clients: needed on tcp://

    def __post_init__(self) -> None:
        object.__setattr__(self, "disk_cache_dir", Path(self.disk_cache_dir))
        check_disk_cache_bytes(self.disk_cache_bytes)
        check_max_pinned_fraction(self.max_pinned_fraction)
        check_cache_encrypt(self.cache_encrypt, self.cache_key_file)
        ServiceTuning(self.disk_sync, self.io_threads, self.workers, self.client_ttl_s)  # checks
        if "://" not in self.address:
            raise ValueError(
                f"--address must be a ZeroMQ address like ipc://PATH, got {self.address}"
            )
        _check_local(self.address, self.curve)
        if self.curve is not None:
            self.curve.check()
        if self.leased_by is not None and self.leased_by <= 0:
            raise ValueError(f"--leased-by must be a pid, got {self.leased_by}")

    @classmethod
    def from_configs(
        cls,
        cache: CacheConfig,
        tuning: ServiceTuning,
        address: str,
        direct_io: bool = True,
        leased_by: int | None = None,
        curve: CurveKeys | None = None,
    ) -> ServiceConfig:
        """The service that `cache` (L3/L4 sizes and policies; its folder set) and `tuning`
        describe."""
        if cache.disk_cache_dir is None:
            raise ValueError("the cache service needs --disk-cache-dir")
        remote = None
        if cache.remote_url is not None:
            remote = RemoteTierConfig(
                cache.remote_url,
                ttl_s=cache.remote_ttl_s,
                disk_admit_hits=cache.disk_admit_hits,
                disk_admit_tokens=cache.disk_admit_tokens,
            )
        return cls(
            disk_cache_dir=cache.disk_cache_dir,
            address=address,
            disk_cache_bytes=cache.disk_cache_bytes,
            io_threads=tuning.io_threads,
            workers=tuning.workers,
            disk_sync=tuning.disk_sync,
            direct_io=direct_io,
            client_ttl_s=tuning.client_ttl_s,
            remote=remote,
            max_pinned_fraction=cache.max_pinned_fraction,
            leased_by=leased_by,
            cache_key_file=cache.cache_key_file,
            cache_encrypt=cache.cache_encrypt,
            curve=curve,
        )

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> ServiceConfig:
        """The service the parsed flags of `add_service_flags` (and the service's own
        --disk-cache-dir, --address, --no-direct-io, --leased-by) describe."""
        cache = CacheConfig(**config_kwargs(CacheConfig, args, disk_cache_dir=args.disk_cache_dir))
        tuning = ServiceTuning(**config_kwargs(ServiceTuning, args))
        secret = getattr(args, "curve_secret_key", None)
        clients = getattr(args, "curve_clients", None)
        if (secret is None) != (clients is None):
            raise ValueError("--curve-secret-key and --curve-clients go together")
        curve = CurveKeys(secret, clients, SERVICE_CURVE_FLAGS) if secret and clients else None
        return cls.from_configs(
            cache, tuning, args.address, not args.no_direct_io, args.leased_by, curve
        )

    @property
    def settings(self) -> ServiceSettings:
        """What a lease compares (the same function on both sides: the connector builds the
        ServiceConfig of the service it would start, and asks for its settings)."""
        remote = self.remote
        return ServiceSettings(
            os.path.realpath(self.disk_cache_dir),
            self.disk_cache_bytes,
            remote.url if remote else None,
            remote.ttl_s if remote else None,
            remote.disk_admit_hits if remote else 0,
            remote.disk_admit_tokens if remote else 0,
        )


# The service's flags that set a CacheConfig field (serve has them in its cache group).
CACHE_FLAGS: Mapping[str, str] = {
    "--disk-cache-gb": "L3 capacity in GiB (2**30 bytes), files already there included",
    "--max-pinned-fraction": "share of the host tier (L2) and of the disk tier (L3, the "
    "whole folder) that pinned pages may take; a pin past it is refused with 409",
    "--disk-admit-hits": "write a page to L3 only after this many hits",
    "--disk-admit-tokens": "...or when its prompt has at least this many tokens",
}
# ...and those that set a ServiceTuning field.
TUNING_FLAGS: Mapping[str, str] = {
    "--disk-sync": "durability of stored pages: one syncfs per store, fdatasync per file, or none",
    "--io-threads": "parallel file reads and writes per namespace",
    "--workers": "cache-service requests (loads, stores) served at once",
    "--client-ttl-s": "seconds after which the service forgets a silent engine",
}


def add_service_flags(
    cache: argparse._ActionsContainer, tuning: argparse._ActionsContainer
) -> None:
    """The service's flags, defaulted by CacheConfig and ServiceTuning (written once there)."""
    add_config_flags(cache, CacheConfig, CACHE_FLAGS)
    cache.add_argument(
        "--remote-url", help="L4 Redis/Valkey URL, e.g. redis://127.0.0.1:6379/0 (default: off)"
    )
    cache.add_argument(
        "--remote-ttl-s",
        type=int,
        default=CacheConfig.remote_ttl_s,
        help="L4 value expiry in seconds (default: the server evicts)",
    )
    cache.add_argument(
        "--cache-key-file",
        type=Path,
        help="a 0600 file of secrets (one per line, the first signs): every L3 page and L4 "
        "value carries a keyed MAC and one that does not verify is a miss (docs/security.md; "
        "default: off)",
    )
    cache.add_argument(
        "--cache-encrypt",
        action="store_true",
        help="with --cache-key-file: every L3 page and L4 value is also encrypted (AES-256-GCM, "
        "a per-namespace key from the same secrets; token ids stay readable in the header; "
        "docs/security.md)",
    )
    add_config_flags(tuning, ServiceTuning, TUNING_FLAGS)


def service_argv(cache: CacheConfig, tuning: ServiceTuning) -> list[str]:
    """The flags of the table that give `cache`'s and `tuning`'s values (what a launcher
    passes to `asynchicache service`)."""
    argv = config_argv(cache, CACHE_FLAGS) + config_argv(tuning, TUNING_FLAGS)
    if cache.remote_url is not None:
        argv += ["--remote-url", cache.remote_url]
    if cache.remote_ttl_s is not None:
        argv += ["--remote-ttl-s", str(cache.remote_ttl_s)]
    if cache.cache_key_file is not None:
        argv += ["--cache-key-file", str(cache.cache_key_file)]
    if cache.cache_encrypt:
        argv.append("--cache-encrypt")
    return argv


SERVICE_CURVE_FLAGS = ("--curve-secret-key", "--curve-clients")


def _check_local(address: str, curve: CurveKeys | None) -> None:
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
            f"--address must be ipc://PATH or tcp://127.0.0.1:PORT (the service trusts its "
            f"clients: it stays on this machine), got {address}"
        )
    if curve is None:
        raise ValueError(
            f"--address {address}: any local user can connect to a loopback port, so the "
            "service's tcp:// needs ZeroMQ CURVE (--curve-secret-key and --curve-clients); "
            "or use ipc://PATH in a private folder (the default)"
        )
