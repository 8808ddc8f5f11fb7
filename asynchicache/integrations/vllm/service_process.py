"""Starting a cache service for vLLM when none answers at the configured address.

    python -m asynchicache.integrations.vllm.service_process --lock PATH --parent-pid PID \
        -- --disk-cache-dir DIR --socket ipc://...

One service per address: the child takes an exclusive `flock` on `PATH` before
it binds, so when two vLLM instances start at once only one service runs (the
other child exits at once, and its vLLM connects to the winner). The lock goes
with the process, so a crashed service frees the address for the next start.

The service belongs to the vLLM process that started it: it stops (cleanly,
its writes finished) when that process's connector shuts down, or when that
process is gone, even after a SIGKILL, because it watches that pid. It
detaches first (a second fork, its own session): vLLM SIGKILLs the
descendants of its engine core at shutdown, which would cut a page write
short. Other vLLM instances using it then find no service and
start their own; until it answers they serve by recompute.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asynchicache.integrations.vllm.config import ConnectorConfig
from asynchicache.storage import service, service_cli
from asynchicache.storage.liveness import pid_alive
from asynchicache.storage.service import default_runtime_dir

log = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


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


def stop_own_service(address: str, timeout_s: float) -> None:
    """Stop the service at `address` if this process started it (it finishes its writes)."""
    holder = service_holder(address)
    if holder is None or holder[1] != os.getpid() or not pid_alive(holder[0]):
        return
    os.kill(holder[0], signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(holder[0]) and time.monotonic() < deadline:
        time.sleep(0.05)


def lock_path(address: str) -> Path:
    """The lock file that guards `address` (next to an ipc socket, else in the runtime dir)."""
    if address.startswith("ipc://"):
        return Path(address[len("ipc://") :] + ".lock")
    tag = address.replace("://", "-").replace(":", "-").replace("/", "-")
    return default_runtime_dir() / f"{tag}.lock"


def service_args(config: ConnectorConfig) -> list[str]:
    """The service's own flags for what the connector was configured with."""
    args = [
        "--disk-cache-dir",
        str(config.disk_cache_dir),
        "--socket",
        config.service_address,
        "--disk-cache-gb",
        str(config.disk_cache_gb),
        "--log-level",
        config.service_log_level,
    ]
    if config.remote_url:
        args += ["--remote-url", config.remote_url]
    if config.remote_ttl:
        args += ["--remote-ttl", str(config.remote_ttl)]
    if not config.direct_io:
        args.append("--no-direct-io")
    return args


def spawn_service(config: ConnectorConfig) -> subprocess.Popen:
    """Start a service child for `config` (it exits at once if another holds the lock)."""
    address = config.service_address
    service.prepare_address(address)
    lock = lock_path(address)
    lock.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "asynchicache.integrations.vllm.service_process",
        "--lock",
        str(lock),
        "--parent-pid",
        str(os.getpid()),
        "--",
        *service_args(config),
    ]
    log.info("starting an asynchicache cache service at %s", address)
    # Its own session: a Ctrl-C meant for vLLM must not cut a write short; the
    # child stops by itself when we exit.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)


def _watch_owner(owner: int) -> None:
    while pid_alive(owner):
        threading.Event().wait(_PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the service's handler: finish writes, then exit


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
    # Who serves the address, and for whom (tools, tests, the owner's clean stop).
    os.write(fd, f"{os.getpid()} {args.parent_pid}\n".encode())
    threading.Thread(target=_watch_owner, args=(args.parent_pid,), daemon=True).start()
    return service_cli.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
