"""Starting a cache service for vLLM when none answers at the configured address.

    python -m asynchicache.integrations.vllm.l2.service_process --lock PATH --parent-pid PID \
        -- --disk-cache-dir DIR --address ipc://...

One service per address: the child takes an exclusive `flock` on `PATH` before
it binds, so when two vLLM instances start at once only one service runs (the
other child exits at once, and its vLLM connects to the winner). The lock goes
with the process, so a crashed service frees the address for the next start.

The service belongs to every vLLM instance that uses it, not to the one that
started it: each holds a lease (storage.service.leases, renewed by its
`ServiceLink`), and the service runs `--leased-by` its starter, which holds the
first lease until it takes its own. When the last lease ends (released by a
connector's shutdown, or its engine core gone, even after a SIGKILL) the
service finishes the work in flight and exits. An instance whose settings differ
from the running service's is refused its lease (the fields are named) and fails
at start. The service detaches first (a second fork, its own session): vLLM
SIGKILLs the descendants of its engine core at shutdown, which would cut a page
write short, and another instance may still need it.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from asynchicache.common.liveness import pid_alive
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.settings.config import CacheConfig, ServiceTuning
from asynchicache.storage.messages import ServiceSettings
from asynchicache.storage.service import service_cli
from asynchicache.storage.service.service_config import (
    ServiceConfig,
    default_runtime_dir,
    prepare_address,
    prepare_runtime_dir,
    service_argv,
)

log = logging.getLogger(__name__)


def service_holder(address: str) -> tuple[int, int] | None:
    """(pid, owner pid) of the service holding `address`'s lock, as it wrote them there."""
    try:
        fields = lock_path(address).read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        return None
    return int(fields[0]), int(fields[1])


def service_pid(address: str) -> int | None:
    """The pid of the service holding `address`'s lock (tools, tests)."""
    holder = service_holder(address)
    return None if holder is None else holder[0]


def wait_service_gone(address: str, timeout_s: float) -> bool:
    """Wait until no service holds `address` (its last lease ended and it exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid = service_pid(address)
        if pid is None or not pid_alive(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def lock_path(address: str) -> Path:
    """The lock file that guards `address` (next to an ipc socket, else in the runtime dir)."""
    if address.startswith("ipc://"):
        return Path(address[len("ipc://") :] + ".lock")
    tag = address.replace("://", "-").replace(":", "-").replace("/", "-")
    return default_runtime_dir() / f"{tag}.lock"


def _service_cache(config: ConnectorConfig) -> CacheConfig:
    """The connector's keys as the tier settings of the service it starts: the one place
    they change form (`service_config` and `service_args` both read this)."""
    return CacheConfig(
        disk_cache_dir=config.disk_cache_dir,
        disk_cache_gb=config.disk_cache_gb,
        remote_url=config.remote_url,
        remote_ttl_s=config.remote_ttl_s,
        cache_key_file=config.cache_key_file,
        cache_encrypt=config.cache_encrypt,
    )


def service_config(config: ConnectorConfig) -> ServiceConfig:
    """The service this connector starts when none answers at its address, built as
    `serve` and the service's own command line build theirs
    (`ServiceConfig.from_configs`). Its `settings` are what the connector's lease asks
    for (`service_settings`), read by the same property the service reads its own with."""
    return ServiceConfig.from_configs(
        _service_cache(config),
        ServiceTuning(),
        config.service_address,
        direct_io=config.direct_io,
    )


def service_settings(config: ConnectorConfig) -> ServiceSettings:
    """The settings of the service this connector would start: what its lease asks for."""
    return service_config(config).settings


def service_args(config: ConnectorConfig) -> list[str]:
    """The flags that start `service_config(config)` (the child parses them back into an
    equal config; tests/vllm/parts/test_vllm_service_process.py): written from the
    service's flag table (storage/service/service_config.py, `service_argv`)."""
    args = ["--disk-cache-dir", str(config.disk_cache_dir), "--address", config.service_address]
    args += service_argv(_service_cache(config), ServiceTuning())
    args += ["--log-level", config.service_log_level]
    if not config.direct_io:
        args.append("--no-direct-io")
    return args


def spawn_service(config: ConnectorConfig) -> subprocess.Popen:
    """Start a service child for `config` (it exits at once if another holds the lock)."""
    address = config.service_address
    prepare_address(address)
    lock = lock_path(address)
    prepare_runtime_dir(lock.parent)
    cmd = [
        sys.executable,
        "-m",
        "asynchicache.integrations.vllm.l2.service_process",
        "--lock",
        str(lock),
        "--parent-pid",
        str(os.getpid()),
        "--",
        *service_args(config),
    ]
    log.info("starting an asynchicache cache service at %s", address)
    # Its own session: a Ctrl-C meant for vLLM must not cut a write short; the
    # service stops by itself when the last lease on it ends.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="asynchicache-vllm-service")
    parser.add_argument("--lock", type=Path, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    if os.fork():  # detach from vLLM's process tree (see the module docstring)
        os._exit(0)
    fd = os.open(args.lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another service holds this address
    os.ftruncate(fd, 0)
    # Who serves the address, and who started it (tools, tests).
    os.write(fd, f"{os.getpid()} {args.parent_pid}\n".encode())
    return service_cli.main([*rest, "--leased-by", str(args.parent_pid)])


if __name__ == "__main__":
    raise SystemExit(main())
