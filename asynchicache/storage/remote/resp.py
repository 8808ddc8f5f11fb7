"""A minimal RESP2 connection for moving whole pages to and from Redis/Valkey.

redis-py (with hiredis) parses a bulk reply into a fresh `bytes` object, which
the caller then copies again into the L2 slot: two copies of 737 KB per page
on top of the kernel's, and all of it under the GIL. Measured on loopback this
caps a GET pipeline at about 0.25 GB/s. Here the bulk payload of a GET is
received with `recv_into` straight into the slot's memoryview and a SET is
sent with `sendmsg` straight from it, so a page crosses user space once.

Only what page traffic needs is here: connect (TCP or TLS, AUTH, SELECT),
send a list of buffers, read a status/integer/bulk reply. Everything else
(cluster topology, EXISTS, UNLINK, SCAN) goes through redis-py.

Time: every recv waits at most the socket timeout, and `set_time_limit` bounds
a whole reply (a page trickling in byte by byte cannot hold a caller longer);
passing it raises `TimeoutError`.

Errors: an `OSError` (refused, reset, timed out, `RespProtocolError`) means
the connection is unusable and must be closed; a `RespError` is an error
reply from the server ("-ERR ...", "-MOVED ...") and leaves it in sync.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asynchicache.storage.header import Buffer

_CRLF = b"\r\n"
_READ_CHUNK = 1 << 16
# Socket buffer sizes are left to the kernel: setting SO_RCVBUF turns TCP autotuning off
# (and is capped by net.core.rmem_max); a fixed 4 MiB measured no faster on loopback.
_IOV_MAX = 1024


class RespError(Exception):
    """An error reply ("-ERR ...", "-MOVED 3999 10.0.0.1:6381"); the connection stays usable."""

    @property
    def kind(self) -> str:
        return str(self).split(" ", 1)[0]


class RespProtocolError(ConnectionError):
    """The reply stream is not what RESP2 allows: the connection is out of sync."""


@dataclass(frozen=True)
class NodeAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ConnectionParams:
    """How to open and authenticate a data connection (derived from the remote URL)."""

    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: bool = False
    tls_verify: bool = True
    tls_ca_file: str | None = None
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 2.0


def command(*args: bytes) -> bytes:
    """One command in RESP2 framing (for small arguments; pages go through `send`)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


class RespConnection:
    """One TCP (or TLS) connection to one Redis node; not thread-safe."""

    def __init__(self, address: NodeAddress, params: ConnectionParams) -> None:
        self.address = address
        self.uses = 0  # times lent out by a pool (a reused connection may have gone stale)
        self._buf = bytearray(_READ_CHUNK)
        self._start = 0
        self._end = 0
        self._timeout = params.socket_timeout_s
        self._until: float | None = None  # monotonic time every recv must finish by
        self._sock = self._open(address, params)
        try:
            self._handshake(params)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(address: NodeAddress, params: ConnectionParams) -> socket.socket:
        sock = socket.create_connection((address.host, address.port), params.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if params.tls:
                sock = _tls_context(params).wrap_socket(sock, server_hostname=address.host)
            sock.settimeout(params.socket_timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, params: ConnectionParams) -> None:
        if params.password is not None:
            auth = [b"AUTH"]
            if params.username:
                auth.append(params.username.encode())
            auth.append(params.password.encode())
            self.send([command(*auth)])
            self.read_status()
        if params.db:
            self.send([command(b"SELECT", str(params.db).encode())])
            self.read_status()

    def set_time_limit(self, until: float | None) -> None:
        """Make every recv until further notice finish by `until` (monotonic seconds), or
        raise TimeoutError; None: only the per-recv socket timeout applies."""
        self._until = until
        if until is None:
            self._sock.settimeout(self._timeout)

    @property
    def tls(self) -> bool:
        return isinstance(self._sock, ssl.SSLSocket)

    # -- sending ----------------------------------------------------------

    def send(self, buffers: Sequence[Buffer]) -> None:
        """Send every buffer in order, without joining them (pages go out from their slots)."""
        if self.tls or len(buffers) == 1:
            for b in buffers:
                self._sock.sendall(b)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        while views:
            sent = self._sock.sendmsg(views[:_IOV_MAX])
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    # -- receiving --------------------------------------------------------

    def read_line(self) -> bytes:
        """The next CRLF-terminated line, without the CRLF."""
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf) - 2:
                raise RespProtocolError("reply line longer than 64 KiB")
            self._fill()

    def read_status(self) -> bytes:
        """A "+OK"-style reply; raises RespError on an error reply."""
        line = self._reply_line()
        if line[:1] != b"+":
            raise RespProtocolError(f"expected a status reply, got {line[:40]!r}")
        return line[1:]

    def read_int(self) -> int:
        line = self._reply_line()
        if line[:1] != b":":
            raise RespProtocolError(f"expected an integer reply, got {line[:40]!r}")
        return _to_int(line[1:])

    def read_bulk_len(self) -> int | None:
        """The length of the next bulk reply, None for a nil; the caller reads the body."""
        line = self._reply_line()
        if line[:1] != b"$":
            raise RespProtocolError(f"expected a bulk reply, got {line[:40]!r}")
        n = _to_int(line[1:])
        return None if n < 0 else n

    def read_into(self, view: memoryview) -> None:
        """Fill `view` exactly: from what is buffered, then straight from the socket."""
        view = view.cast("B")
        have = min(len(view), self._end - self._start)
        view[:have] = self._buf[self._start : self._start + have]
        self._start += have
        got = have
        while got < len(view):
            n = self._recv_into(view[got:])
            if n == 0:
                raise RespProtocolError("connection closed in the middle of a reply")
            got += n

    def skip(self, n: int) -> None:
        """Discard `n` bytes of the stream (the rest of a value we refuse)."""
        scratch = memoryview(bytearray(min(n, _READ_CHUNK)))
        while n:
            take = min(n, len(scratch))
            self.read_into(scratch[:take])
            n -= take

    def end_bulk(self) -> None:
        """Consume the CRLF that ends a bulk reply."""
        tail = bytearray(2)
        self.read_into(memoryview(tail))
        if tail != _CRLF:
            raise RespProtocolError("bulk reply not terminated by CRLF")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _reply_line(self) -> bytes:
        line = self.read_line()
        if line[:1] == b"-":
            raise RespError(line[1:].decode("utf-8", errors="replace"))
        return line

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        n = self._recv_into(memoryview(self._buf)[self._end :])
        if n == 0:
            raise RespProtocolError("connection closed by the server")
        self._end += n

    def _recv_into(self, view: memoryview) -> int:
        if self._until is not None:
            left = self._until - time.monotonic()
            if left <= 0:
                raise TimeoutError("reply time limit reached")
            self._sock.settimeout(min(left, self._timeout))
        return self._sock.recv_into(view)


def _to_int(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError as exc:
        raise RespProtocolError(f"bad number in reply: {raw[:40]!r}") from exc


def _tls_context(params: ConnectionParams) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=params.tls_ca_file)
    if not params.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
