"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

A key that is one of serve's settings has the name of serve's config field, which is
also serve's flag (`disk_cache_gb`, `--disk-cache-gb`; `prefetch_timeout_s`,
`--prefetch-timeout-s`), and takes its default from that dataclass (`SERVE_SETTINGS`):
a default is written once. Where vLLM needs another default, it is a named override
with its reason (`VLLM_OVERRIDES`). The other keys are the connector's own. All are
optional, in settings/config.py's units: sizes in GiB (2**30 bytes, `_gb`), durations in
seconds (`_s`). An unknown key is an error that lists the known ones, so a typo does
not silently fall back to a default. The duration keys of earlier releases
(`lookup_timeout`, `remote_ttl`, ...: without the `_s`) are still read, as the
documented names they were (`OLD_KEYS`). tests/server/test_config_vocabulary.py walks
every key back to its one field.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import xxhash

from asynchicache.settings.config import (
    GIB,
    CacheConfig,
    EngineConfig,
    LaunchConfig,
    default_disk_cache_dir,
)
from asynchicache.storage.service.server import default_runtime_dir
from asynchicache.storage.service.service_config import ServiceConfig

LOAD_POLICIES = ("cost", "always")

# Documented keys of earlier releases -> today's (durations without their unit suffix).
OLD_KEYS = {
    "service_start_timeout": "service_start_timeout_s",
    "lookup_timeout": "lookup_timeout_s",
    "prefetch_timeout": "prefetch_timeout_s",
    "store_timeout": "store_timeout_s",
    "remote_ttl": "remote_ttl_s",
}

# The keys that are serve's settings -> the dataclass whose field of the same name they
# are (and whose default they take, VLLM_OVERRIDES aside).
SERVE_SETTINGS: Mapping[str, type] = MappingProxyType({
    "disk_cache_dir": CacheConfig,
    "disk_cache_gb": CacheConfig,
    "host_cache_gb": CacheConfig,
    "page_size": CacheConfig,
    "remote_url": CacheConfig,
    "remote_ttl_s": CacheConfig,
    "prefetch_timeout_s": CacheConfig,
    "cache_key_file": CacheConfig,
    "cache_encrypt": CacheConfig,
    "min_load_tokens": EngineConfig,
    "kv_events_pool": LaunchConfig,
    "kv_events_shared_disk": LaunchConfig,
    "direct_io": ServiceConfig,  # the service's --no-direct-io
})  # fmt: skip


@dataclass(frozen=True)
class VllmOverride:
    """A default of serve's that the connector does not take, and why."""

    value: Any
    why: str


VLLM_OVERRIDES: Mapping[str, VllmOverride] = MappingProxyType({
    "min_load_tokens": VllmOverride(0, "the connector's default since its first release "
        "(docs/vllm.md): its cost rule (load_policy `cost`) already recomputes every hit that "
        "does not pay at the rates measured on vLLM's own steps, and `always` is what tests "
        "of the tiers' mechanics use to load one-page hits"),
    "direct_io": VllmOverride(False, "a restarted vLLM reads back what its predecessor "
        "wrote moments ago, which the page cache still holds; O_DIRECT skips it and waits on "
        "the device (a 1,500-token prompt read 40 ms buffered, 0.6-0.8 s O_DIRECT on a busy "
        "VM)"),
})  # fmt: skip


def _serve_default(key: str) -> Any:
    """The default of a key that is one of serve's settings (the one place it is written,
    or the named override)."""
    override = VLLM_OVERRIDES.get(key)
    return override.value if override is not None else getattr(SERVE_SETTINGS[key], key)


@dataclass(frozen=True)
class ConnectorConfig:
    """What `AsynchicacheConnector` needs beyond vLLM's own config."""

    disk_cache_dir: Path = field(default_factory=default_disk_cache_dir)  # CacheConfig's
    disk_cache_gb: float = _serve_default("disk_cache_gb")
    host_cache_gb: float = _serve_default("host_cache_gb")  # this instance's L2 segment, GiB
    page_size: int = _serve_default("page_size")  # tokens per page; divides vLLM's block size
    remote_url: str | None = _serve_default("remote_url")  # L4, when we start the service
    remote_ttl_s: int | None = _serve_default("remote_ttl_s")
    # The cache service's ZeroMQ address; None: one per disk folder in the runtime dir,
    # so every vLLM on the machine that uses the same folder shares one service.
    cache_service: str | None = None
    start_service: bool = True  # start a service when none answers at the address
    service_start_timeout_s: float = 60.0  # to wait for it at vLLM start-up
    lookup_timeout_s: float = 0.5  # an unanswered "how far does the chain exist" is 0
    prefetch_timeout_s: float = _serve_default("prefetch_timeout_s")  # then a load is a miss
    store_timeout_s: float = 60.0  # a store the service has not finished by then failed
    # Hits shorter than this are recomputed; longer ones are loaded when loading them
    # beats recomputing them at the rates measured (load_policy.py).
    min_load_tokens: int = _serve_default("min_load_tokens")  # VLLM_OVERRIDES: 0
    # vLLM's load_kv_async. Off: a hit (verified in L2 before it is offered) is copied
    # into vLLM's blocks right before the forward pass that computes the rest of the
    # prompt. On: the request waits in WAITING_FOR_REMOTE_KVS and is computed a step
    # later, for a copy that takes a fraction of a step (a 16-token hit cost a whole
    # step of TTFT on a CPU).
    load_async: bool = False
    # "cost": load a hit, read pages into L2 and wait for a lookup only when it beats
    # recomputing at the measured rates (load_policy.py); "always": every hit of at
    # least min_load_tokens, whatever it costs (what tests of the tiers' mechanics
    # on a model too small to pay for a load use).
    load_policy: str = "cost"
    service_log_level: str = "WARNING"
    # O_DIRECT page files in a service we start: off (VLLM_OVERRIDES says why).
    direct_io: bool = _serve_default("direct_io")
    # A service we start signs (and, cache_encrypt, encrypts) every L3/L4 page with the
    # secrets of this file: serve's --cache-key-file / --cache-encrypt (docs/security.md).
    cache_key_file: Path | None = _serve_default("cache_key_file")  # noqa: RUF009 (None)
    cache_encrypt: bool = _serve_default("cache_encrypt")
    # serve's --kv-events-pool / --kv-events-shared-disk: with vLLM's --kv-events-config,
    # the pages the service stored (medium DISK) go out with `ownership` = this pool when
    # the storage is the fleet's (the disk folder declared shared, or an L4 the service
    # writes every stored page through to), llm-d's `pool:<name>`. vllm-router 0.1.17 then
    # prices them at --kv-penalty-external, still for the announcing instance only
    # (docs/fleet.md).
    kv_events_pool: str = _serve_default("kv_events_pool")
    kv_events_shared_disk: bool = _serve_default("kv_events_shared_disk")

    def __post_init__(self) -> None:
        object.__setattr__(self, "disk_cache_dir", Path(self.disk_cache_dir).expanduser())
        if self.cache_key_file is not None:
            object.__setattr__(self, "cache_key_file", Path(self.cache_key_file).expanduser())
        if self.cache_encrypt and self.cache_key_file is None:
            raise ValueError(
                "kv_connector_extra_config.cache_encrypt needs cache_key_file (the pages' "
                "keys derive from its secrets)"
            )
        for name in (
            "disk_cache_gb",
            "host_cache_gb",
            "page_size",
            "lookup_timeout_s",
            "prefetch_timeout_s",
            "store_timeout_s",
            "service_start_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"kv_connector_extra_config.{name} must be positive, "
                    f"got {getattr(self, name)!r}"
                )
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"kv_connector_extra_config.load_policy must be one of {LOAD_POLICIES}, "
                f"got {self.load_policy!r}"
            )
        if self.min_load_tokens < 0:
            raise ValueError("kv_connector_extra_config.min_load_tokens must be >= 0")
        if self.remote_ttl_s is not None and self.remote_ttl_s <= 0:
            raise ValueError("kv_connector_extra_config.remote_ttl_s must be positive seconds")
        if not self.kv_events_pool:
            raise ValueError("kv_connector_extra_config.kv_events_pool must not be empty")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Build from `kv_connector_extra_config`; unknown keys raise, naming the known."""
        extra = {OLD_KEYS.get(k, k): v for k, v in (extra or {}).items()}
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**{k: _coerce(known[k], v) for k, v in extra.items()})

    @property
    def service_address(self) -> str:
        if self.cache_service:
            return self.cache_service
        folder = os.path.realpath(self.disk_cache_dir)
        tag = xxhash.xxh3_64_hexdigest(folder.encode())[:12]
        return f"ipc://{default_runtime_dir() / f'cache-{tag}.sock'}"

    @property
    def storage_ownership(self) -> str | None:
        """The `ownership` of the service's stored pages in KV events: the pool when they
        are in a tier the fleet shares (the folder declared shared, or written through to
        L4), None when only this machine's service can read them."""
        shared = self.kv_events_shared_disk or self.remote_url is not None
        return self.kv_events_pool if shared else None

    @property
    def host_cache_bytes(self) -> int:
        """host_cache_gb in bytes (GiB, as every size flag)."""
        return int(self.host_cache_gb * GIB)


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """JSON gives strings and numbers; turn "true"/"1" into bools for the bool fields."""
    if f.type in ("bool", bool) and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value
