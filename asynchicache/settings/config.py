"""Frozen, validated configuration, split by concern.

Each dataclass validates itself in `__post_init__` and names the CLI flag that
was wrong. Derived values are properties; nothing mutates a config once built.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from numbers import Integral, Real
from pathlib import Path


class WritePolicy(StrEnum):
    """When L1 pages are copied to L2 (names as in SGLang HiCache)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class SyncMode(StrEnum):
    """--disk-sync: how the cache service makes a put's pages durable before they get
    their real names (storage/disk/write.py).

    Correctness never depends on it (every read is verified; a crash leaves no
    half file under a real name); it decides whether a stored page survives a
    power loss.
    """

    BATCH = "batch"  # one syncfs per put: one device flush for all its pages
    FILE = "file"  # fdatasync every file: portable, one flush per page
    NONE = "none"  # leave it to the kernel's writeback (~30 s)


class PrefetchPolicy(StrEnum):
    """How long a request waits for its L3/L4 prefix before it prefills."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


# Every size flag (--host-cache-gb, --disk-cache-gb, ...) counts GiB: 2**30 bytes.
# One unit everywhere, and a token count turned into GiB (a power of two) and
# back into bytes is exact in floating point.
GIB = 2**30


def default_disk_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asynchicache" / "kv"


def flag_of(field_name: str) -> str:
    """The flag that sets a config field, unit suffix and all: `foo_bar_s` -> `--foo-bar-s`
    (settings/config_flags.py: one name per setting, old names as deprecated aliases)."""
    return "--" + field_name.replace("_", "-")


def check_numbers(config: object, flags: Mapping[str, str] | None = None) -> None:
    """Every int and float field of a config dataclass holds a number of its type (a bool,
    a string or a float where an int belongs is refused) and a finite one: nan would pass
    every comparison below unnoticed, inf would overflow a size. The error names the
    field's flag (`flags` for the fields whose flag is named otherwise)."""
    for f in fields(config):  # type: ignore[arg-type]
        kind = str(f.type).replace(" | None", "").replace("None | ", "")
        if kind not in ("int", "float"):
            continue
        value = getattr(config, f.name)
        if value is None and "None" in str(f.type):
            continue
        name = (flags or {}).get(f.name) or flag_of(f.name)
        wanted = Integral if kind == "int" else Real
        if isinstance(value, bool) or not isinstance(value, wanted):
            what = "an integer" if kind == "int" else "a number"
            raise ValueError(f"{name} must be {what}, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_cache_encrypt(encrypt: bool, key_file: Path | None) -> None:
    if encrypt and key_file is None:
        raise ValueError(
            "--cache-encrypt needs --cache-key-file (the pages' keys derive from its secrets)"
        )


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        listed = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ValueError(f"{name} must be {listed}, got {value!r}")


def check_max_pinned_fraction(value: float) -> None:
    """--max-pinned-fraction: the share of L2 and of L3 pins may hold (CacheConfig's,
    the cache service's and its disk tier's field: checked here, once)."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--max-pinned-fraction must be in [0, 1], got {value}")


def check_disk_cache_bytes(value: int) -> None:
    """--disk-cache-gb, in bytes (the cache service's and its disk tier's disk_cache_bytes)."""
    if value <= 0:
        raise ValueError(f"--disk-cache-gb must be positive, got {value} bytes")


@dataclass(frozen=True)
class CacheConfig:
    """The tiers: sizes, policies and where they live."""

    page_size: int = 16
    device_cache_tokens: int = 16384
    host_cache_gb: float = 2.0
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 2.0
    # ...plus this much per 1,024 tokens of the load (SGLang's prefetch_timeout_per_ki_token).
    prefetch_timeout_per_ki_token_s: float = 0.0
    # Start a queued request's L3/L4 -> L2 read when it arrives, not when it is
    # admitted (engine/scheduling/prefetch.py); False: at admission.
    arrival_prefetch: bool = True
    enable_prefix_cache: bool = True
    enable_host_cache: bool = True
    disk_cache_dir: Path | None = field(default_factory=default_disk_cache_dir)
    disk_cache_gb: float = 20.0
    disk_admit_hits: int = 0
    disk_admit_tokens: int = 0
    remote_url: str | None = None
    remote_ttl_s: int | None = None
    # Secrets that sign and verify every page of L3 and L4 (storage/page_keys.py).
    cache_key_file: Path | None = None
    # ...and also encrypt them (AES-256-GCM, storage/page_cipher.py): needs cache_key_file.
    cache_encrypt: bool = False
    # Share of L2 slots that timed-out storage tickets may hold quarantined before
    # new storage loads and stores pause (recompute instead of shrinking L2 to nothing).
    max_quarantine_fraction: float = 0.25
    # Share of L2 (here) and of L3 (the cache service) that pins may hold.
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        check_numbers(self)
        _positive("--page-size", self.page_size)
        check_max_pinned_fraction(self.max_pinned_fraction)
        check_cache_encrypt(self.cache_encrypt, self.cache_key_file)
        if not 0.0 <= self.max_quarantine_fraction <= 1.0:
            raise ValueError(
                f"--max-quarantine-fraction must be in [0, 1], got {self.max_quarantine_fraction}"
            )
        _positive("--device-cache-tokens", self.device_cache_tokens)
        _non_negative("--host-cache-gb", self.host_cache_gb)
        check_disk_cache_bytes(self.disk_cache_bytes)
        _non_negative("--disk-admit-hits", self.disk_admit_hits)
        _non_negative("--disk-admit-tokens", self.disk_admit_tokens)
        _positive("--write-through-threshold", self.write_through_threshold)
        _positive("--prefetch-timeout-s", self.prefetch_timeout_s)
        _non_negative("--prefetch-timeout-per-ki-token-s", self.prefetch_timeout_per_ki_token_s)
        if self.device_cache_tokens < self.page_size:
            raise ValueError(
                f"--device-cache-tokens ({self.device_cache_tokens}) must hold at least "
                f"one page of --page-size ({self.page_size}) tokens"
            )
        if not isinstance(self.write_policy, WritePolicy):
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        if not isinstance(self.prefetch_policy, PrefetchPolicy):
            object.__setattr__(self, "prefetch_policy", PrefetchPolicy(self.prefetch_policy))

    @property
    def device_pages(self) -> int:
        return self.device_cache_tokens // self.page_size

    @property
    def host_cache_bytes(self) -> int:
        """--host-cache-gb in bytes (GiB)."""
        return int(self.host_cache_gb * GIB)

    @property
    def disk_cache_bytes(self) -> int:
        """--disk-cache-gb in bytes (GiB)."""
        return int(self.disk_cache_gb * GIB)

    @property
    def disk_enabled(self) -> bool:
        return self.enable_prefix_cache and self.disk_cache_dir is not None

    @property
    def host_enabled(self) -> bool:
        return self.enable_prefix_cache and self.enable_host_cache and self.host_cache_gb > 0


@dataclass(frozen=True)
class EngineConfig:
    """The model and how the scheduler batches it."""

    model: str | None = None  # HF folder or GGUF file; None = the embedded SmolLM2
    device: str = "cpu"
    dtype: str = "float32"
    # A cap on requests running at once; what L1 holds decides first
    # (engine/scheduling/memory_budget.py).
    max_running_requests: int = 256
    # Decode tokens admission reserves L1 room for, per request (at most its max_tokens).
    decode_reserve_tokens: int = 256
    chunked_prefill_size: int = 512
    max_prefill_tokens: int = 2048
    # A step's target: its new tokens are what the measured pace computes in this time
    # (engine/scheduling/prefill_policy.py); 0: no time bound, only the token budgets above. Off by
    # default until a quiet-machine sweep picks a value: the only runs so far (a busy host,
    # docs/benchmarks.md 2026-12-06) lost a third of the requests/s with 250 ms.
    max_step_ms: float = 0.0
    max_model_len: int | None = None  # None = the model's own context length
    # Loads below this many tokens are not worth a round trip to a lower tier.
    min_load_tokens: int = 32
    seed: int = 0
    threads: int | None = None  # torch threads of the engine; None = engine.threads default
    # Last-position logits of recent prompts (engine/sampling/prompt_logits.py); 0 turns them off.
    prompt_logits_mib: int = 64

    def __post_init__(self) -> None:
        check_numbers(self)
        _one_of("--dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _positive("--max-running-requests", self.max_running_requests)
        _positive("--decode-reserve-tokens", self.decode_reserve_tokens)
        _positive("--chunked-prefill-size", self.chunked_prefill_size)
        _positive("--max-prefill-tokens", self.max_prefill_tokens)
        _non_negative("--max-step-ms", self.max_step_ms)
        _non_negative("--min-load-tokens", self.min_load_tokens)
        _non_negative("--prompt-logits-mib", self.prompt_logits_mib)
        if self.max_model_len is not None:
            _positive("--max-model-len", self.max_model_len)
        if self.threads is not None:
            _positive("--threads", self.threads)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end: where it listens, who may call it, how long it waits."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None = no authentication
    # Guards the cache admin routes (clear, pin, unpin) apart from --api-key;
    # None = they take the same key as everything else.
    admin_api_key: str | None = None
    log_level: str = "info"
    served_model_name: str | None = None  # None = the loaded model's own name
    startup_timeout_s: float = 600.0  # model load + first health answer
    # The engine answers a health ping between two steps: silent this long, it is taken
    # as hung (SIGSTOP, a deadlock), killed and restarted; its requests end with an error.
    engine_step_timeout_s: float = 60.0
    # From a generation's start to its last token; then it is aborted (HTTP 504).
    request_timeout_s: float = 3600.0
    # At SIGTERM: how long running requests may finish (then each ends with an error),
    # and then how long each child may take to stop before SIGKILL.
    shutdown_timeout_s: float = 15.0
    # A larger request body is answered 413 before it is read (server/guards/body_limit.py).
    max_request_bytes: int = 8 * 2**20
    # Generated tokens one HTTP request may ask (prompts x best_of x max_tokens);
    # None: server/guards/work_bound.py's default for the model's context.
    max_request_tokens: int | None = None
    # Work requests (generation, tokenize) running at once, and waiting for a turn;
    # past both, a 429 with Retry-After (server/guards/admission.py).
    max_concurrent_requests: int = 512
    max_waiting_requests: int = 1024
    # A connection that has not sent a whole request head this long after it opened (or
    # after its last answer) is closed (server/http.py: slow-header clients).
    header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_numbers(self)
        for name, key in (("--api-key", self.api_key), ("--admin-api-key", self.admin_api_key)):
            if key is not None and not isinstance(key, str):
                raise ValueError(f"{name} must be a string, got a {type(key).__name__}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        _one_of("--log-level", self.log_level, ("debug", "info", "warning", "error", "critical"))
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("--admin-api-key must not be empty")
        _positive("--startup-timeout-s", self.startup_timeout_s)
        _positive("--shutdown-timeout-s", self.shutdown_timeout_s)
        _positive("--engine-step-timeout-s", self.engine_step_timeout_s)
        _positive("--request-timeout-s", self.request_timeout_s)
        _positive("--max-request-bytes", self.max_request_bytes)
        if self.max_request_tokens is not None:
            _positive("--max-request-tokens", self.max_request_tokens)
        _positive("--max-concurrent-requests", self.max_concurrent_requests)
        _non_negative("--max-waiting-requests", self.max_waiting_requests)
        _positive("--header-timeout-s", self.header_timeout_s)


@dataclass(frozen=True)
class ServiceTuning:
    """How hard the cache service (L3/L4 process) works; `serve` passes these through."""

    disk_sync: SyncMode = SyncMode.BATCH
    io_threads: int = 16  # parallel file I/O per namespace
    workers: int = 4  # requests served at once
    client_ttl_s: float = 120.0  # an engine silent this long is forgotten

    def __post_init__(self) -> None:
        check_numbers(self)
        _one_of("--disk-sync", self.disk_sync, tuple(SyncMode))
        object.__setattr__(self, "disk_sync", SyncMode(self.disk_sync))
        _positive("--io-threads", self.io_threads)
        _positive("--workers", self.workers)
        _positive("--client-ttl-s", self.client_ttl_s)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `asynchicache serve` was asked for."""

    server: ServerConfig
    engine: EngineConfig
    cache: CacheConfig
    service: ServiceTuning = field(default_factory=ServiceTuning)
    # LightLLM's --hiradix_cache_token_num: the host tier's size in tokens,
    # turned into bytes once the model's KV size per token is known.
    host_cache_tokens: int | None = None
    # --storage-timeout-s: how long the engine waits for one cache-service ticket (an
    # L3/L4 load or store) before it gives up on it; 3x that, silent, restarts the service.
    storage_timeout_s: float = 10.0
    # --kv-events-endpoint / --kv-events-replay-endpoint (kv_events/publisher.py); None: off.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # Who may read them (kv_events/access.py): beyond this machine only when
    # allowed, and then with CURVE keys (the server's certificate, the clients' folder).
    kv_events_allow_remote: bool = False
    kv_events_curve_secret_key: Path | None = None
    kv_events_curve_clients: Path | None = None
    kv_events_plaintext: bool = False  # tcp:// without CURVE (routers that lack it)
    kv_events_topic: str = ""  # vLLM's topic frame
    kv_events_pool: str = "pool:asynchicache"  # `ownership` of the fleet's shared pages
    kv_events_shared_disk: bool = False  # the L3 folder is the fleet's: announce it as the pool's

    def __post_init__(self) -> None:
        check_numbers(self, {"host_cache_tokens": "--hiradix_cache_token_num"})
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        curve = (self.kv_events_curve_secret_key, self.kv_events_curve_clients)
        if (curve[0] is None) != (curve[1] is None):
            raise ValueError("--kv-events-curve-secret-key and --kv-events-curve-clients go "
                             "together")  # fmt: skip
        if self.cache.remote_url is not None and not self.cache.disk_enabled:
            raise ValueError(
                "--remote-url needs the disk tier (drop --no-disk-cache/--no-prefix-cache): "
                "the cache service keeps L4 behind L3"
            )
        if self.host_cache_tokens is not None and self.host_cache_tokens <= 0:
            raise ValueError(
                "the L2 size in tokens (--hiradix_cache_token_num, --hicache-ratio) must be "
                f"positive, got {self.host_cache_tokens}"
            )
        if not (math.isfinite(self.storage_timeout_s) and self.storage_timeout_s > 0):
            raise ValueError(
                f"--storage-timeout-s must be a positive number of seconds, "
                f"got {self.storage_timeout_s}"
            )
