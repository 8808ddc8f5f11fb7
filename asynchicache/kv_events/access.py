"""Who may read the KV event sockets (`--kv-events-endpoint`, `--kv-events-replay-endpoint`).

The events say which prompts are cached (the token ids of unsalted prompts, page
hashes), so by default only this machine's user reads them:

* `ipc://PATH` in a folder private to this user (0700, ours; made so when missing), or
  `inproc://`: the default, and what a router on this machine should use;
* `tcp://` on a loopback address (127.0.0.0/8, ::1, localhost) is reachable by every
  user of this machine, so it needs ZeroMQ CURVE keys or `--kv-events-plaintext` (the
  operator accepts that local users read the events: routers without CURVE support,
  e.g. vllm-router 0.1.17, on a single-user host);
* anything else (`tcp://*`, `tcp://0.0.0.0`, another address, an interface or host
  name) is refused unless `--kv-events-allow-remote` is given, and then needs CURVE
  or `--kv-events-plaintext` the same way; other transports are refused.

CURVE: the server's key pair (`--kv-events-curve-secret-key`, a certificate file as
`zmq.auth.create_certificates` writes it) encrypts, and only clients whose public keys
lie in `--kv-events-curve-clients` (a folder of such files) may connect (a ZAP
authenticator in the engine process checks each one). With keys given, CURVE guards
both sockets, local ones too.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from asynchicache.common.curve import ClientCurve, CurveGuard, CurveKeys
from asynchicache.common.fileio import make_private_dir, private_dir_problem

# The CURVE helpers live in common/curve.py (the cache service's tcp:// uses them too).
__all__ = [
    "LOOPBACK_HINT",
    "REMOTE_HINT",
    "ClientCurve",
    "CurveGuard",
    "CurveKeys",
    "check_endpoint",
    "is_loopback",
    "is_private",
    "prepare_ipc",
]

REMOTE_HINT = (
    "events reveal which prompts are cached: use ipc://PATH (a private folder), or pass "
    "--kv-events-allow-remote with --kv-events-curve-secret-key and --kv-events-curve-clients "
    "(ZeroMQ CURVE), or with --kv-events-plaintext for a router that has no CURVE"
)
LOOPBACK_HINT = (
    "every user of this machine can connect to a loopback port and read which prompts are "
    "cached: use ipc://PATH (a private folder), CURVE keys (--kv-events-curve-secret-key, "
    "--kv-events-curve-clients), or accept it with --kv-events-plaintext"
)


def is_private(address: str) -> bool:
    """Whether only this user can reach a ZeroMQ address (see the module doc)."""
    scheme, _, rest = address.partition("://")
    if scheme == "inproc":
        return True
    return scheme == "ipc" and _private_folder(Path(rest).parent)


def is_loopback(address: str) -> bool:
    """Whether a `tcp://` address is this machine's only (any local user may connect)."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # *, an interface or a host name: not provably local
        return False


def _private_folder(folder: Path) -> bool:
    """A real folder of ours (not a symlink) that no one else may enter, or one still to
    be made."""
    try:
        return private_dir_problem(folder) is None
    except FileNotFoundError:
        return True  # made 0700 at bind time


def check_endpoint(
    flag: str, address: str, allow_remote: bool, curve: CurveKeys | None, plaintext: bool = False
) -> None:
    """ValueError naming `flag` when `address` is not allowed (see the module doc)."""
    if "://" not in address:
        raise ValueError(f"{flag} must be a ZeroMQ address like ipc:///run/ac/events.sock, "
                         f"got {address!r}")  # fmt: skip
    if is_private(address):
        return
    if address.startswith("ipc://"):
        raise ValueError(f"{flag} {address}: the socket's folder must be this user's own and "
                         "private (0700): anyone who can enter it can read the events")  # fmt: skip
    if is_loopback(address):
        if curve is None and not plaintext:
            raise ValueError(f"{flag} {address}: {LOOPBACK_HINT}")
        return
    if not address.startswith("tcp://"):
        raise ValueError(f"{flag} {address}: only ipc://, inproc:// and tcp:// are supported")
    if not allow_remote:
        raise ValueError(f"{flag} {address} listens beyond this machine; {REMOTE_HINT}")
    if curve is None and not plaintext:
        raise ValueError(f"{flag} {address}: a remote endpoint needs ZeroMQ CURVE keys ("
                         "--kv-events-curve-secret-key and --kv-events-curve-clients), or "
                         "--kv-events-plaintext")  # fmt: skip


def prepare_ipc(address: str) -> None:
    """Make the folder of an `ipc://` address 0700 when missing (an existing one is
    checked by `check_endpoint`, never changed)."""
    if address.startswith("ipc://"):
        make_private_dir(Path(address[len("ipc://") :]).parent)
