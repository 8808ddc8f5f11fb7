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
import os
from dataclasses import dataclass
from pathlib import Path

import zmq

from asynchicache.storage.fileio import make_private_dir

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


@dataclass(frozen=True)
class CurveKeys:
    """The server's certificate (public and secret key) and the folder of the public key
    files of the clients allowed in."""

    secret_key_file: Path
    clients_dir: Path

    def check(self) -> None:
        """ValueError when a file is missing or holds no secret key, or CURVE is absent."""
        if not zmq.has("curve"):
            raise ValueError("this libzmq has no CURVE support: remote KV events are refused")
        _public, secret = self.load()
        if not secret:
            raise ValueError(f"--kv-events-curve-secret-key {self.secret_key_file} holds no "
                             "secret key (give the '.key_secret' file)")  # fmt: skip
        if not self.clients_dir.is_dir():
            raise ValueError(f"--kv-events-curve-clients {self.clients_dir} is not a folder")

    def load(self) -> tuple[bytes, bytes | None]:
        import zmq.auth

        try:
            return zmq.auth.load_certificate(self.secret_key_file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--kv-events-curve-secret-key {self.secret_key_file}: {exc}") from exc


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
    """An existing folder of ours that no one else may enter, or one still to be made."""
    try:
        st = folder.stat()
    except FileNotFoundError:
        return True  # made 0700 at bind time
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


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


class CurveGuard:
    """The ZAP authenticator that lets in only the listed clients, and the server keys
    put on each socket; `close()` stops the authenticator."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        keys.check()
        self._public, secret = keys.load()
        assert secret is not None  # checked
        self._secret = secret
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(keys.clients_dir))

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds)."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()


@dataclass(frozen=True)
class ClientCurve:
    """A subscriber's CURVE keys: the server's public key and its own certificate."""

    server_public_key_file: Path
    client_secret_key_file: Path

    def apply(self, sock: zmq.Socket) -> None:
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(self.server_public_key_file)
        public, secret = zmq.auth.load_certificate(self.client_secret_key_file)
        if secret is None:
            raise ValueError(f"{self.client_secret_key_file} holds no secret key")
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
