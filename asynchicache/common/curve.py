"""ZeroMQ CURVE for our sockets: who may connect, and encryption on the way.

A server's certificate (`zmq.auth.create_certificates`: a `.key_secret` file) and a
folder of the public `.key` files of the clients let in (`CurveKeys`); a ZAP
authenticator thread in the server's context checks each client (`CurveGuard`); a
client carries the server's public key and its own certificate (`ClientCurve`).
Used by the KV event sockets (kv_events/access.py) and the cache service's
`tcp://` socket (storage/service/service_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq


@dataclass(frozen=True)
class CurveKeys:
    """The server's certificate (public and secret key) and the folder of the public key
    files of the clients allowed in."""

    secret_key_file: Path
    clients_dir: Path
    # The flags that gave them, for errors: (secret key flag, clients flag).
    flags: tuple[str, str] = ("--kv-events-curve-secret-key", "--kv-events-curve-clients")

    def check(self) -> None:
        """ValueError when a file is missing or holds no secret key, or CURVE is absent."""
        if not zmq.has("curve"):
            raise ValueError(f"this libzmq has no CURVE support: {self.flags[0]} is refused")
        _public, secret = self.load()
        if not secret:
            raise ValueError(f"{self.flags[0]} {self.secret_key_file} holds no "
                             "secret key (give the '.key_secret' file)")  # fmt: skip
        if not self.clients_dir.is_dir():
            raise ValueError(f"{self.flags[1]} {self.clients_dir} is not a folder")

    def load(self) -> tuple[bytes, bytes | None]:
        import zmq.auth

        try:
            return zmq.auth.load_certificate(self.secret_key_file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.flags[0]} {self.secret_key_file}: {exc}") from exc


class CurveGuard:
    """The ZAP authenticator that lets in only the listed clients, and the server keys
    put on each socket; `close()` stops the authenticator."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        keys.check()
        self._public, secret = keys.load()
        assert secret is not None  # checked
        self._secret = secret
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(keys.clients_dir))

    def secure(self, sock: zmq.Socket[Any]) -> None:
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

    def apply(self, sock: zmq.Socket[Any]) -> None:
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(self.server_public_key_file)
        public, secret = zmq.auth.load_certificate(self.client_secret_key_file)
        if secret is None:
            raise ValueError(f"{self.client_secret_key_file} holds no secret key")
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
